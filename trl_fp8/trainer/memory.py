"""What holds a trainer's GPU memory: parameters, gradients, DDP's buckets, optimizer states, the FP8 weight cache,
and what the allocator and the device report beside them.

PyTorch's own counters cannot tell these apart, and they count more than the GPU holds when vLLM sleeps: vLLM's
sleep-mode pool allocates through PyTorch's allocator and unmaps its memory while asleep, so `memory_allocated` keeps
counting it. The device's own figure (`mem_get_info`) is what a run can run out of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trl_fp8.nn.weight_cache import fp8_weight_cache_bytes
from trl_fp8.trainer.choice import StartUpChoice

__all__ = [
    "GradientSyncChoice",
    "WeightCacheChoice",
    "choose_fp8_kv_cache",
    "choose_fp8_weight_cache",
    "choose_fsdp2_gradient_sync",
    "memory_breakdown",
    "start_up_sequence_tokens",
]


def start_up_sequence_tokens(args) -> int | None:
    """The tokens a sequence is sized at before the first rollout: `vllm_max_model_length`, else
    `max_completion_length` (the prompts are not known at start-up)."""
    return args.vllm_max_model_length or args.max_completion_length


def _storages(tensors) -> dict[int, int]:
    """Bytes of each distinct storage under `tensors` (a DTensor counts its local shard), by storage address."""
    out = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _ddp_bucket_bytes(wrapped: nn.Module) -> int:
    """Bytes of DDP's all-reduce buckets (0 when `wrapped` is not a DistributedDataParallel module)."""
    if not isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return 0
    sizes = str(wrapped._get_ddp_logging_data().get("bucket_sizes", "") or "")
    return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)


def memory_breakdown(model: nn.Module, optimizer=None, wrapped: nn.Module | None = None) -> dict[str, int]:
    """Bytes held by `model`'s parameters, its live gradients (those that are not views of DDP's buckets), DDP's
    buckets (`wrapped`: the DDP module, if any), `optimizer`'s states and the FP8 weight cache; and, on a GPU, what
    PyTorch's allocator counts as allocated and reserved and what the device has in use (every process on it)."""
    params = _storages(model.parameters())
    buckets = _ddp_bucket_bytes(wrapped) if wrapped is not None else 0
    grads = _storages(p.grad for p in model.parameters())
    # With gradient_as_bucket_view the gradients are views of the buckets: counted once, as buckets.
    in_buckets = bool(buckets) and getattr(wrapped, "gradient_as_bucket_view", False)
    states = {}
    if optimizer is not None:
        states = _storages(t for state in optimizer.state.values() for t in state.values())
    out = {
        "parameters": sum(params.values()),
        "gradients": 0 if in_buckets else sum(n for ptr, n in grads.items() if ptr not in params),
        "ddp_buckets": buckets,
        "optimizer_states": sum(n for ptr, n in states.items() if ptr not in params),
        "fp8_weight_cache": fp8_weight_cache_bytes(model),
    }
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                   device_used=total - free)  # fmt: skip
    return out


@dataclass(frozen=True)
class WeightCacheChoice:
    """Whether FP8 layers keep their quantized weights between forwards (`cache`), and why (`reason`, for the log);
    `with_grad`: whether they keep them through the training micro-batches too (`FP8LinearConfig.cache_with_grad`;
    None: as `fp8_cache_weights` says)."""

    cache: bool
    reason: str
    automatic: bool = True
    with_grad: bool | None = None


def _gpu_bytes(args) -> int | None:
    """The memory of the GPU the run trains on (None off a GPU: no limit to respect)."""
    device = torch.device(args.device)
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _planned_training(
    shape, args, total_bytes: int, processes: int, cache_with_grad: bool = True, **launch
) -> tuple[dict, dict, float, str]:
    """The planner's account of one GPU's training phase for this run (`trl_fp8.rollout.capacity`, as `trl-fp8 plan`
    prints it): `(the trainer's parts, what vLLM holds beside them, the phase's bytes, the optimizer counted)`.
    `launch`: `trainer_memory_per_gpu`'s launch options. An optimizer the planner does not model counts as
    adamw_torch; beside the trainer, vLLM's share, or what it keeps asleep in sleep mode. `cache_with_grad`: whether
    the FP8 weight cache stays through the micro-batches (`capacity.training_phase_bytes`)."""
    from trl_fp8.rollout import capacity

    optim = str(getattr(args.optim, "value", args.optim))
    counted = optim if optim in capacity.OPTIMIZER_STATE_BYTES else "adamw_torch"
    parts = capacity.trainer_memory_per_gpu(
        shape, num_processes=processes, optim=counted, micro_batch=args.per_device_train_batch_size,
        seq_len=start_up_sequence_tokens(args),
        gradient_checkpointing=bool(args.gradient_checkpointing), **launch,
    )  # fmt: skip
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    vllm = {"share_bytes": args.vllm_gpu_memory_utilization * total_bytes if colocated else 0.0,
            "sleep_mode": colocated and args.vllm_enable_sleep_mode,
            "max_num_seqs": max(1, args.generation_batch_size // processes) if colocated else 0}  # fmt: skip
    training = capacity.training_phase_bytes(parts, shape, **vllm, cache_with_grad=cache_with_grad)
    return parts, vllm, training, counted


def choose_fp8_weight_cache(model_config, args, *, lora: bool = False, total_bytes: int | None = None):
    """The FP8 weight cache for this run: the user's `fp8_cache_weights` if set; else on, for the scoring passes and
    the vLLM sync only (`FP8LinearConfig.cache_with_grad=False`), unless holding it while scoring would push the
    training phase of one GPU past `FP8_CACHE_HEADROOM` of its memory by the planner's account
    (`trl_fp8.rollout.capacity`, the numbers `trl-fp8 plan` prints).

    The cache costs 1 byte per FP8 weight and saves re-quantizing each weight at every forward. Kept through the
    micro-batches as well (`fp8_cache_weights=True`) it saves a little of the training phase's time and raises the
    training peak above BF16's by its bytes (bench_grpo's `*_nocache` runs: docs/benchmarks.md, "GRPO at 64 x 1k:
    backends, weight cache, profile" and "GRPO with Liger's kernels, compiled layers and the fusions"); held for
    scoring only, the micro-batches' peak is BF16's. Under FSDP2 it is never kept (it would undo the sharding).
    `total_bytes`: the GPU's memory (read from `args.device` when None; no GPU: no limit to respect)."""
    from trl_fp8.distributed import weight_sharding
    from trl_fp8.rollout import capacity

    if args.fp8_cache_weights is not None:
        return WeightCacheChoice(args.fp8_cache_weights, "set by fp8_cache_weights", automatic=False)
    if weight_sharding(args) == "FSDP2":
        return WeightCacheChoice(False, "FSDP2 shards the weights; a whole FP8 copy on every rank would undo it")
    total_bytes = total_bytes or _gpu_bytes(args)
    if total_bytes is None:  # (off a GPU the cache costs no GPU memory: kept through the micro-batches too)
        return WeightCacheChoice(True, f"training on {torch.device(args.device).type}, no GPU memory to keep",
                                 with_grad=True)  # fmt: skip
    try:
        shape = capacity.ModelShape.from_config(model_config)
    except ValueError as exc:
        return WeightCacheChoice(True, f"kept: the memory planner cannot size this model ({exc})")
    parts, vllm, peak, counted = _planned_training(
        shape, args, total_bytes, max(1, args.world_size), cache_with_grad=False, launch="ddp",
        grads_in_ddp_buckets=args.ddp_gradient_as_bucket_view, fp8_training=True, fp8_weight_cache=True, lora=lora,
    )  # fmt: skip
    optim = str(getattr(args.optim, "value", args.optim))
    gib, cache = capacity.GiB, parts["fp8_weight_cache"]
    numbers = (f"the planner puts one GPU's training phase at {peak / gib:.1f} GiB with the cache "
               f"({cache / gib:.1f} GiB) held while scoring the rollouts and let go in the micro-batches, of "
               f"{total_bytes / gib:.1f} GiB" + ("" if counted == optim else f", {optim} counted as adamw_torch"))  # fmt: skip
    if capacity.keeps_fp8_weight_cache(parts, shape, total_bytes, **vllm):
        # the micro-batches quantize every weight at each forward; the trade the other way is one byte a weight
        return WeightCacheChoice(True, f"{numbers}; fp8_cache_weights=True keeps it through the micro-batches too "
                                 "(fewer quantizations, that much more memory at the training peak)")  # fmt: skip
    return WeightCacheChoice(
        False,
        f"{numbers}: scoring with it would pass {capacity.FP8_CACHE_HEADROOM:.0%} of the GPU and set the peak, so "
        "weights are quantized at every forward instead (a few percent of the training phase); set "
        "fp8_cache_weights=True to keep it anyway",
    )


@dataclass(frozen=True)
class GradientSyncChoice:
    """Whether every micro-batch reduce-scatters its gradients under FSDP2 (accelerate's `sync_each_batch`), and why."""

    sync_each_batch: bool
    reason: str
    automatic: bool = True


def choose_fsdp2_gradient_sync(
    model_config, args, *, num_processes: int | None = None, total_bytes: int | None = None
) -> GradientSyncChoice | None:
    """Accelerate's `sync_each_batch` for an FSDP2 run with gradient accumulation, where the user left it unset.

    transformers' Trainer runs all micro-batches of a step but the last under accelerate's `no_sync`, which FSDP2
    carries out by keeping every gradient whole in BF16 until the last one: 2 bytes a parameter of the whole model on
    every GPU. Where that would push one GPU's training phase past `FSDP2_GRADIENTS_HEADROOM` of its memory by the
    planner's account (`trl_fp8.rollout.capacity`, as `trl-fp8 plan` prints it), every micro-batch reduce-scatters
    instead, so the gradients stay sharded, for one more reduce-scatter of them per micro-batch; otherwise
    accelerate's default stays. None where there is nothing to choose: no FSDP2, one process, one micro-batch a step,
    or no GPU to size. `total_bytes`: the GPU's memory (read from `args.device` when None)."""
    from trl_fp8.distributed import weight_sharding
    from trl_fp8.rollout import capacity

    processes = num_processes or max(1, args.world_size)
    if weight_sharding(args) != "FSDP2" or processes == 1 or args.gradient_accumulation_steps <= 1:
        return None
    kwargs = args.accelerator_config.gradient_accumulation_kwargs or {}
    if "sync_each_batch" in kwargs:
        return GradientSyncChoice(bool(kwargs["sync_each_batch"]), "set in accelerator_config", automatic=False)
    total_bytes = total_bytes or _gpu_bytes(args)
    if total_bytes is None:
        return None
    try:
        shape = capacity.ModelShape.from_config(model_config)
    except ValueError as exc:
        return GradientSyncChoice(
            False, f"accelerate's default kept: the memory planner cannot size this model ({exc})"
        )
    parts, _, training, _ = _planned_training(shape, args, total_bytes, processes, launch="fsdp2",
                                              accumulates_gradients=True, fp8_training=args.fp8_recipe is not None)  # fmt: skip
    gib, whole = capacity.GiB, parts["unsharded_gradients"]
    numbers = (f"with {args.gradient_accumulation_steps} micro-batches a step FSDP2 keeps the whole model's gradients "
               f"in BF16 between them ({whole / gib:.1f} GiB a GPU), which puts one GPU's training at "
               f"{training / gib:.1f} of {total_bytes / gib:.1f} GiB by the planner's account")  # fmt: skip
    if training <= capacity.FSDP2_GRADIENTS_HEADROOM * total_bytes:
        return GradientSyncChoice(False, f"{numbers}; accelerator_config={{'gradient_accumulation_kwargs': "
                                  "{'sync_each_batch': True}} would keep them sharded")  # fmt: skip
    return GradientSyncChoice(
        True,
        f"{numbers}, above {capacity.FSDP2_GRADIENTS_HEADROOM:.0%}: every micro-batch reduce-scatters them instead (set "
        "accelerator_config={'gradient_accumulation_kwargs': {'sync_each_batch': False}} to keep accelerate's default)",
    )


def choose_fp8_kv_cache(
    model_config, args, *, total_bytes: int | None = None, capability: tuple[int, int] | None = None
) -> StartUpChoice:
    """The KV cache of the colocated engine: the user's `fp8_kv_cache` if set; else FP8 where a rollout's sequences
    would not all fit a BF16 KV cache at once, by the planner's account (`trl_fp8.rollout.capacity`, as
    `trl-fp8 plan` prints it), and BF16 where they fit.

    Where the BF16 cache binds, the FP8 cache holds about twice the sequences, and a GRPO step runs clearly faster
    with it; where every sequence fits, it runs about as fast as the BF16 cache, for several times the
    trainer-vs-rollout KL (measured: docs/when-fp8-pays.md, "The FP8 KV cache: on where the BF16 cache would bind").
    So it is chosen only where it pays, on Hopper (vLLM's FP8 attention is FlashAttention-3's), in the FP8 flow with
    TRL's importance-sampling correction on. Sequences count `vllm_max_model_length` tokens, else
    `max_completion_length` (the prompts are not known before the first rollout, whose log line says whether the
    cache bound). `total_bytes` and `capability`: the GPU's memory and compute capability (read from `args.device`
    when None)."""
    from trl_fp8.rollout import capacity

    if args.fp8_kv_cache is not None:
        return StartUpChoice(bool(args.fp8_kv_cache), "set by fp8_kv_cache", automatic=False)
    if not args.use_vllm:
        return StartUpChoice(False, "no vLLM rollouts")
    if args.fp8_recipe is None:
        return StartUpChoice(False, "the BF16 baseline (fp8_recipe=None) keeps TRL's BF16 KV cache")
    if args.vllm_mode != "colocate":
        return StartUpChoice(False, "the vLLM server's own --kv_cache_dtype sets it; for an FP8 KV cache start it "
                             "with --kv_cache_dtype fp8 and set fp8_kv_cache=True")  # fmt: skip
    if not getattr(args, "vllm_importance_sampling_correction", False):  # (RLOO's config has none)
        return StartUpChoice(False, "no importance-sampling correction of the rollouts, which the FP8 KV cache's "
                             "larger trainer-vs-rollout mismatch needs; set fp8_kv_cache=True to use it anyway")  # fmt: skip
    if capability is None:
        device = torch.device(args.device)
        if device.type != "cuda":
            return StartUpChoice(False, f"training on {device.type}: vLLM's FP8 attention needs a Hopper GPU")
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) != (9, 0):
        return StartUpChoice(False, f"vLLM's FP8 attention (FlashAttention-3) runs on Hopper (sm90), this GPU is "
                             f"sm{capability[0]}{capability[1]}")  # fmt: skip
    try:
        shape = capacity.ModelShape.from_config(model_config)
    except (ValueError, AttributeError) as exc:
        return StartUpChoice(False, f"kept BF16: the memory planner cannot size this model ({exc})")
    total_bytes = total_bytes or _gpu_bytes(args)
    tp = args.vllm_tensor_parallel_size
    sequences = max(1, args.generation_batch_size // max(1, args.world_size)) * tp  # one engine's, per rollout
    seq_len = start_up_sequence_tokens(args)
    share = args.vllm_gpu_memory_utilization

    def room(fp8_kv: bool) -> int:
        return capacity.rollout_capacity(
            shape, total_bytes, share, fp8_weights=args.rollout_precision != "bf16", fp8_kv=fp8_kv, seq_len=seq_len,
            max_num_seqs=sequences, tensor_parallel_size=tp,
        ).sequences  # fmt: skip

    bf16 = room(False)
    numbers = (f"by the planner's account vLLM's {share:.0%} of the GPU has room for {bf16} of a rollout's "
               f"{sequences} sequences of {seq_len:,} tokens at once with a BF16 KV cache")  # fmt: skip
    if bf16 >= sequences:
        return StartUpChoice(False, f"{numbers}: every sequence fits, so an FP8 cache would add mismatch for little "
                             "speed (set fp8_kv_cache=True to use it anyway)")  # fmt: skip
    return StartUpChoice(
        True,
        f"{numbers}, {room(True)} with an FP8 one, whose keys and values round to FP8 with scales measured on the "
        "trainer's forward (a larger trainer-vs-rollout mismatch, which importance sampling corrects); set "
        "fp8_kv_cache=False to keep BF16",
    )
