"""The run's automatic choices, each a function of the run's settings (`args`, read, never written), the model's
config and the machine (read from `args.device` unless given): Liger's kernels, the FP8 weight cache, FSDP2's
`sync_each_batch`, the colocated engine's FP8 KV cache, and GRPO's token-level TIS and scoring of the rollouts in the
training forward. Each returns a `Choice` with its reason; `FP8RunPlan` holds them, and the trainer and `trl-fp8 plan`
read them from there.

Liger's fused RMSNorm, RoPE and SwiGLU take the part of the training phase that FP8 layers leave in BF16 (elementwise
kernels and reductions, a large share of it at the 8B shape: docs/contributing/benchmark-details.md, "GRPO at 64 x 1k:
backends, weight cache, profile"), so they pay most beside FP8 GEMMs. Measured with TRL's `use_liger_kernel=True` on
Qwen3 shapes, with and without them: the same page, "GRPO with Liger's kernels, compiled layers and the fusions", and
for the 8B GRPO step at TRL's colocate defaults that chose the default, docs/contributing/engineering-notes.md, "One
H100, 2026-11-26: with and without Liger's kernels". They are put on the model exactly as that option does
(transformers' `apply_liger_kernel` when training starts, TRL's `liger_kernel_config`), where that is what was
measured: a dense decoder of a family whose layers Liger patches with these three kernels, trained on a CUDA GPU, with
liger-kernel installed.
"""

from __future__ import annotations

import torch

import trl_fp8.plan.memory as memory
from trl_fp8.config import BLOCKWISE
from trl_fp8.plan.choice import Choice, TokenTIS, WeightCache
from trl_fp8.rollout import capacity
from trl_fp8.tuning import FP8Tuning

__all__ = [
    "HOPPER",
    "LIGER_DENSE_MODEL_TYPES",
    "choose_fp8_kv_cache",
    "choose_fp8_weight_cache",
    "choose_fsdp2_gradient_sync",
    "choose_liger_kernels",
    "choose_scoring",
    "choose_token_tis",
    "rollouts_from_another_engine",
    "start_up_sequence_tokens",
]

# Dense decoders whose RMSNorm, RoPE and SwiGLU MLP Liger replaces (liger_kernel.transformers'
# `apply_liger_kernel_to_*`), with the MLP's gate/up/down projections kept as modules our FP8 layers replace.
# Mixture-of-experts types stay out: Liger's patches of their expert MLPs were never run with FP8 experts.
LIGER_DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def choose_liger_kernels(model_type: str | None, args, *, cuda: bool, tuning: FP8Tuning | None = None) -> Choice:
    """The run's `use_liger_kernel`: the user's where set; else on for a dense model of `LIGER_DENSE_MODEL_TYPES`
    trained on a CUDA GPU (`cuda`) with liger-kernel installed, in blockwise FP8 or BF16, outside compiled decoder
    layers (torchao's recipes are not yet measured with them; compiled layers with them were slower). `tuning`: the
    run's `FP8Tuning` (None: its defaults)."""
    from transformers.utils import is_liger_kernel_available

    tuning = FP8Tuning.of(tuning)

    if args.use_liger_kernel is not None:
        return Choice(bool(args.use_liger_kernel), "set by use_liger_kernel", automatic=False)
    if not cuda:
        return Choice(False, "no CUDA GPU to train on (Liger's kernels are Triton kernels)")
    if model_type not in LIGER_DENSE_MODEL_TYPES:
        return Choice(
            False,
            f"model type {model_type!r} is not one of the dense decoders they are used on "
            f"({', '.join(LIGER_DENSE_MODEL_TYPES)}); use_liger_kernel=True puts them on anyway",
        )
    if args.fp8_recipe not in (BLOCKWISE, None):
        return Choice(False, f"torchao's {args.fp8_recipe!r} recipe is not measured with them yet")
    if tuning.compile_decoder_layers:
        return Choice(
            False,
            "FP8Tuning(compile_decoder_layers=True) compiles the layers instead (Liger's kernels inside compiled layers "
            "ran the 8B GRPO step slower than Liger's alone: docs/when-fp8-pays.md)",
        )
    if not is_liger_kernel_available():
        return Choice(False, "liger-kernel is not installed: pip install 'trl-fp8[liger]' for a faster training phase")
    reason = "their fused RMSNorm, RoPE and SwiGLU take the training phase's BF16 work beside the FP8 GEMMs"
    if tuning.fuse_swiglu:
        reason += " (SwiGLU left to FP8Tuning(fuse_swiglu=True))"
    return Choice(True, reason + "; use_liger_kernel=False turns them off")


HOPPER = (9, 0)  # the compute capability of vLLM's FP8 attention (FlashAttention-3)


def start_up_sequence_tokens(args) -> int | None:
    """The tokens a sequence is sized at before the first rollout: `vllm_max_model_length`, else
    `max_completion_length` (the prompts are not known at start-up)."""
    return args.vllm_max_model_length or args.max_completion_length


def _gpu_bytes(args) -> int | None:
    """The memory of the GPU the run trains on (None off a GPU: no limit to respect)."""
    device = torch.device(args.device)
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _planned_training(
    shape, args, total_bytes: int, processes: int, cache_with_grad: bool = True, **launch
) -> tuple[dict, dict, float, str]:
    """The planner's account of one GPU's training phase for this run (`trl_fp8.plan.memory`, as `trl-fp8 plan`
    prints it): `(the trainer's parts, what vLLM holds beside them, the phase's bytes, the optimizer counted)`.
    `launch`: `trainer_memory_per_gpu`'s launch options. An optimizer the planner does not model counts as
    adamw_torch; beside the trainer, vLLM's share, or what it keeps asleep in sleep mode. `cache_with_grad`: whether
    the FP8 weight cache stays through the micro-batches (`memory.training_phase_bytes`)."""
    optim = str(getattr(args.optim, "value", args.optim))
    counted = optim if optim in memory.OPTIMIZER_STATE_BYTES else "adamw_torch"
    parts = memory.trainer_memory_per_gpu(
        shape, num_processes=processes, optim=counted, micro_batch=args.per_device_train_batch_size,
        seq_len=start_up_sequence_tokens(args),
        gradient_checkpointing=bool(args.gradient_checkpointing), **launch,
    )  # fmt: skip
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    vllm = {"share_bytes": args.vllm_gpu_memory_utilization * total_bytes if colocated else 0.0,
            "sleep_mode": colocated and args.vllm_enable_sleep_mode,
            "max_num_seqs": max(1, args.generation_batch_size // processes) if colocated else 0}  # fmt: skip
    training = memory.training_phase_bytes(parts, shape, **vllm, cache_with_grad=cache_with_grad)
    return parts, vllm, training, counted


def choose_fp8_weight_cache(
    model_config, args, *, lora: bool = False, total_bytes: int | None = None, tuning: FP8Tuning | None = None
):
    """The FP8 weight cache for this run: the user's `fp8_cache_weights` if set; else on, for the scoring passes and
    the vLLM sync only (`FP8LinearConfig.cache_with_grad=False`), unless holding it while scoring would push the
    training phase of one GPU past `FP8_CACHE_HEADROOM` of its memory by the planner's account
    (`trl_fp8.plan.memory`, the numbers `trl-fp8 plan` prints).

    The cache costs 1 byte per FP8 weight and saves re-quantizing each weight at every forward. Kept through the
    micro-batches as well (`fp8_cache_weights=True`) it saves a little of the training phase's time and raises the
    training peak above BF16's by its bytes (bench_grpo's `*_nocache` runs: docs/contributing/benchmark-details.md,
    "GRPO at 64 x 1k: backends, weight cache, profile" and "GRPO with Liger's kernels, compiled layers and the
    fusions"); held for scoring only, the micro-batches' peak is BF16's. Under FSDP2 it is never kept (it would undo
    the sharding). `total_bytes`: the GPU's memory (read from `args.device` when None; no GPU: no limit to respect).
    `tuning`: the run's `FP8Tuning` (None: its defaults; DDP's gradients in its buckets,
    `ddp_gradient_as_bucket_view`)."""
    from trl_fp8.distributed import weight_sharding

    tuning = FP8Tuning.of(tuning)

    if args.fp8_cache_weights is not None:
        kept = WeightCache(True, with_grad=True) if args.fp8_cache_weights else WeightCache(False)
        return Choice(kept, "set by fp8_cache_weights", automatic=False)
    if weight_sharding(args) == "FSDP2":
        return Choice(WeightCache(False), "FSDP2 shards the weights; a whole FP8 copy on every rank would undo it")
    total_bytes = total_bytes or _gpu_bytes(args)
    if total_bytes is None:  # (off a GPU the cache costs no GPU memory: kept through the micro-batches too)
        return Choice(WeightCache(True, with_grad=True),
                      f"training on {torch.device(args.device).type}, no GPU memory to keep")  # fmt: skip
    try:
        shape = capacity.ModelShape.from_config(model_config)
    except ValueError as exc:
        return Choice(WeightCache(True, with_grad=False), f"kept: the memory planner cannot size this model ({exc})")
    parts, vllm, peak, counted = _planned_training(
        shape, args, total_bytes, max(1, args.world_size), cache_with_grad=False, launch="ddp",
        grads_in_ddp_buckets=tuning.ddp_gradient_as_bucket_view, fp8_training=True, fp8_weight_cache=True, lora=lora,
    )  # fmt: skip
    optim = str(getattr(args.optim, "value", args.optim))
    gib, cache = capacity.GiB, parts["fp8_weight_cache"]
    numbers = (f"the planner puts one GPU's training phase at {peak / gib:.1f} GiB with the cache "
               f"({cache / gib:.1f} GiB) held while scoring the rollouts and let go in the micro-batches, of "
               f"{total_bytes / gib:.1f} GiB" + ("" if counted == optim else f", {optim} counted as adamw_torch"))  # fmt: skip
    if memory.keeps_fp8_weight_cache(parts, shape, total_bytes, **vllm):
        # the micro-batches quantize every weight at each forward; the trade the other way is one byte a weight
        return Choice(WeightCache(True, with_grad=False), f"{numbers}; fp8_cache_weights=True keeps it through the "
                      "micro-batches too (fewer quantizations, that much more memory at the training peak)")  # fmt: skip
    return Choice(
        WeightCache(False),
        f"{numbers}: scoring with it would pass {memory.FP8_CACHE_HEADROOM:.0%} of the GPU and set the peak, so "
        "weights are quantized at every forward instead (a few percent of the training phase); set "
        "fp8_cache_weights=True to keep it anyway",
    )


def choose_fsdp2_gradient_sync(
    model_config, args, *, num_processes: int | None = None, total_bytes: int | None = None
) -> Choice | None:
    """Accelerate's `sync_each_batch` for an FSDP2 run with gradient accumulation, where the user left it unset.

    transformers' Trainer runs all micro-batches of a step but the last under accelerate's `no_sync`, which FSDP2
    carries out by keeping every gradient whole in BF16 until the last one: 2 bytes a parameter of the whole model on
    every GPU. Where that would push one GPU's training phase past `FSDP2_GRADIENTS_HEADROOM` of its memory by the
    planner's account (`trl_fp8.plan.memory`, as `trl-fp8 plan` prints it), every micro-batch reduce-scatters
    instead, so the gradients stay sharded, for one more reduce-scatter of them per micro-batch; otherwise
    accelerate's default stays. None where there is nothing to choose: no FSDP2, one process, one micro-batch a step,
    or no GPU to size. `total_bytes`: the GPU's memory (read from `args.device` when None)."""
    from trl_fp8.distributed import weight_sharding

    processes = num_processes or max(1, args.world_size)
    if weight_sharding(args) != "FSDP2" or processes == 1 or args.gradient_accumulation_steps <= 1:
        return None
    kwargs = args.accelerator_config.gradient_accumulation_kwargs or {}
    if "sync_each_batch" in kwargs:
        return Choice(bool(kwargs["sync_each_batch"]), "set in accelerator_config", automatic=False)
    total_bytes = total_bytes or _gpu_bytes(args)
    if total_bytes is None:
        return None
    try:
        shape = capacity.ModelShape.from_config(model_config)
    except ValueError as exc:
        return Choice(False, f"accelerate's default kept: the memory planner cannot size this model ({exc})")
    parts, _, training, _ = _planned_training(shape, args, total_bytes, processes, launch="fsdp2",
                                              accumulates_gradients=True, fp8_training=args.fp8_recipe is not None)  # fmt: skip
    gib, whole = capacity.GiB, parts["unsharded_gradients"]
    numbers = (f"with {args.gradient_accumulation_steps} micro-batches a step FSDP2 keeps the whole model's gradients "
               f"in BF16 between them ({whole / gib:.1f} GiB a GPU), which puts one GPU's training at "
               f"{training / gib:.1f} of {total_bytes / gib:.1f} GiB by the planner's account")  # fmt: skip
    if training <= memory.FSDP2_GRADIENTS_HEADROOM * total_bytes:
        return Choice(False, f"{numbers}; accelerator_config={{'gradient_accumulation_kwargs': "
                                  "{'sync_each_batch': True}} would keep them sharded")  # fmt: skip
    return Choice(
        True,
        f"{numbers}, above {memory.FSDP2_GRADIENTS_HEADROOM:.0%}: every micro-batch reduce-scatters them instead (set "
        "accelerator_config={'gradient_accumulation_kwargs': {'sync_each_batch': False}} to keep accelerate's default)",
    )


def choose_fp8_kv_cache(
    model_config, args, *, total_bytes: int | None = None, capability: tuple[int, int] | None = None
) -> Choice:
    """The KV cache of the colocated engine: the user's `fp8_kv_cache` if set; else FP8 where a rollout's sequences
    would not all fit a BF16 KV cache at once, by the planner's account (`trl_fp8.rollout.capacity`, as
    `trl-fp8 plan` prints it), and BF16 where they fit.

    Where the BF16 cache binds, the FP8 cache holds about twice the sequences, and a GRPO step runs clearly faster
    with it; where every sequence fits, it runs about as fast as the BF16 cache, for several times the
    trainer-vs-rollout KL (measured: docs/when-fp8-pays.md, "The FP8 KV cache").
    So it is chosen only where it pays, on Hopper (vLLM's FP8 attention is FlashAttention-3's), in the FP8 flow with
    TRL's importance-sampling correction on. Sequences count `vllm_max_model_length` tokens, else
    `max_completion_length` (the prompts are not known before the first rollout, whose log line says whether the
    cache bound). `total_bytes` and `capability`: the GPU's memory and compute capability (read from `args.device`
    when None)."""
    if args.fp8_kv_cache is not None:
        return Choice(bool(args.fp8_kv_cache), "set by fp8_kv_cache", automatic=False)
    if not args.use_vllm:
        return Choice(False, "no vLLM rollouts")
    if args.fp8_recipe is None:
        return Choice(False, "the BF16 baseline (fp8_recipe=None) keeps TRL's BF16 KV cache")
    if args.vllm_mode != "colocate":
        return Choice(False, "the vLLM server's own --kv_cache_dtype sets it; for an FP8 KV cache start it "
                             "with --kv_cache_dtype fp8 and set fp8_kv_cache=True")  # fmt: skip
    if not getattr(args, "vllm_importance_sampling_correction", False):  # (RLOO's config has none)
        return Choice(False, "no importance-sampling correction of the rollouts, which the FP8 KV cache's "
                             "larger trainer-vs-rollout mismatch needs; set fp8_kv_cache=True to use it anyway")  # fmt: skip
    if capability is None:
        device = torch.device(args.device)
        if device.type != "cuda":
            return Choice(False, f"training on {device.type}: vLLM's FP8 attention needs a Hopper GPU")
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) != HOPPER:
        return Choice(False, f"vLLM's FP8 attention (FlashAttention-3) runs on Hopper (sm90), this GPU is "
                             f"sm{capability[0]}{capability[1]}")  # fmt: skip
    try:
        shape = capacity.ModelShape.from_config(model_config)
    except (ValueError, AttributeError) as exc:
        return Choice(False, f"kept BF16: the memory planner cannot size this model ({exc})")
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
        return Choice(False, f"{numbers}: every sequence fits, so an FP8 cache would add mismatch for little "
                             "speed (set fp8_kv_cache=True to use it anyway)")  # fmt: skip
    return Choice(
        True,
        f"{numbers}, {room(True)} with an FP8 one, whose keys and values round to FP8 with scales measured on the "
        "trainer's forward (a larger trainer-vs-rollout mismatch, which importance sampling corrects); set "
        "fp8_kv_cache=False to keep BF16",
    )


def rollouts_from_another_engine(args, *, rollout_func: bool) -> bool:
    """Whether the rollouts bring log-probs of an engine other than the trainer's model (vLLM, or a `rollout_func`
    returning them): what importance sampling corrects. Without either, the policy samples its own rollouts."""
    return bool(args.use_vllm or rollout_func)


def choose_token_tis(args, *, rollout_func: bool = False) -> Choice | None:
    """Token-level truncated importance sampling of this run's rollouts (`FP8GRPOConfig.tis`): a `TokenTIS` where it
    corrects them, None where it does not, and why; None for a config without TIS (RLOO's). `rollout_func`: whether
    the trainer was given one. With vLLM, TRL's own loss code applies it (the config maps `tis` onto TRL's
    `vllm_importance_sampling_*` fields); for rollouts of a `rollout_func` without vLLM, the trainer does."""
    if not hasattr(args, "tis"):
        return None
    if not rollouts_from_another_engine(args, rollout_func=rollout_func):
        return Choice(None, "the policy samples its own rollouts (use_vllm=False, no rollout_func): nothing to "
                      "correct", automatic=False)  # fmt: skip
    if args.tis_asks_for_token():
        tis = TokenTIS(args.tis_cap, by_trainer=not args.use_vllm)
        if args.tis == "token":
            return Choice(tis, "set by tis='token'", automatic=False)
        return Choice(tis, "the rollout engine's log-probs differ from the trainer's by its kernels' rounding; each "
                      f"token's ratio pi_train / pi_rollout is capped at tis_cap={args.tis_cap} (tis='auto'; "
                      "tis=None keeps TRL's own correction, tis='off' none)")  # fmt: skip
    if args.tis == "auto":
        return Choice(None, f"TRL's importance sampling as set ({', '.join(args.trl_is_fields_set())})")
    return Choice(None, f"set by tis={args.tis!r}", automatic=False)


def choose_scoring(args, token_tis: Choice) -> Choice:
    """Whether the micro-batches' own forwards give the trainer's log-probs of the rollouts
    (`FP8GRPOConfig.score_in_training_forward`), and why. `token_tis`: the run's `choose_token_tis`."""
    correcting = args.use_vllm and args.vllm_importance_sampling_correction  # TRL's correction of vLLM rollouts
    tis_without_vllm = token_tis.on and token_tis.value.by_trainer
    if not (correcting or tis_without_vllm or (args.use_vllm and args.log_rollout_mismatch)):
        return Choice(False, "nothing scores the rollouts with the trainer", automatic=False)
    if args.score_in_training_forward is not None:
        return Choice(args.score_in_training_forward, "set by score_in_training_forward", automatic=False)
    if not args.rollouts_train_within_one_step():
        return Choice(False, "a rollout's later micro-batches run on updated weights "
                      "(gradient_accumulation_steps is not a multiple of steps_per_generation x "
                      "num_iterations), so the rollout is scored before them")  # fmt: skip
    return Choice(True, "each micro-batch's own forward gives the trainer's log-probs for the importance "
                  "sampling and the mismatch metrics, the values a scoring pass before the micro-batches "
                  "would give (the same weights), one forward fewer per step; "
                  "score_in_training_forward=False keeps TRL's scoring pass")  # fmt: skip
