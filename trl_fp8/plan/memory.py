"""The memory account of the trainer's side of a GPU: what training holds (weights, gradients, optimizer states, the
FP8 weight cache, activations, logits) beside the colocated engine (`trl_fp8.rollout.capacity`), on one GPU or on
each of several, and the arithmetic `trl-fp8 plan` and the run's plan (`plan.choices`) both read: the training
phase, the peak, the best-fit share, the fewest GPUs. Estimates, not measurements.

Several GPUs (`trainer_memory_per_gpu`) follow TRL's colocate mode: one training process on every GPU beside its
engine; the trainer replicates the model (DDP) or shards it (FSDP2, TRL's fsdp2.yaml).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from dataclasses import dataclass

from trl_fp8.requirements import is_bitsandbytes_optimizer
from trl_fp8.rollout.capacity import GiB, ModelShape, RolloutCapacity, rollout_capacity, vllm_overhead_bytes

__all__ = [
    "DTYPE_FOLLOWING_OPTIMIZERS",
    "EIGHT_BIT_OPTIMIZERS",
    "FP8_CACHE_HEADROOM",
    "FSDP2_GRADIENTS_HEADROOM",
    "FSDP2_OPTIM",
    "HELD_BETWEEN_STEPS",
    "LAUNCHES",
    "NCCL_BUFFER_BYTES",
    "OPTIMIZER_STATE_BYTES",
    "PlannedRun",
    "best_fit_share",
    "fewest_fsdp2_gpus",
    "flow_row",
    "fsdp2_gathered_params",
    "keeps_fp8_weight_cache",
    "optimizer_state_bytes",
    "peak_bytes",
    "trainer_memory_bytes",
    "trainer_memory_per_gpu",
    "trainer_peak_bytes",
    "training_phase_bytes",
]

# Optimizer state bytes per trainable BF16 parameter (beyond the parameter and its gradient): AdamW keeps two
# moments in the parameter's dtype, bitsandbytes' 8-bit AdamW two 1-byte moments.
OPTIMIZER_STATE_BYTES = {"adamw_torch": 4, "adamw_torch_fused": 4, "adamw_bnb_8bit": 2, "adamw_8bit": 2,
                         "paged_adamw_8bit": 2, "adafactor": 0, "sgd": 0}  # fmt: skip
# transformers' Trainer keeps the input embedding's 8-bit AdamW states in 32 bits (two float32 moments: 8 bytes;
# docs/contributing/when-fp8-pays-details.md compares the estimate with a measurement).
EIGHT_BIT_OPTIMIZERS = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
EMBEDDING_STATE_BYTES_8BIT = 8
# torch's AdamW keeps its moments in the parameter's dtype: twice the bytes beside FSDP2's float32 masters.
DTYPE_FOLLOWING_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
# How several training processes, one per GPU, hold the model: replicated (DDP) or sharded (FSDP2).
LAUNCHES = ("ddp", "fsdp2")
# Assumed, not measured: NCCL's communicator buffers and the process group's workspace on each GPU of a
# several-process run, DDP or FSDP2 alike.
NCCL_BUFFER_BYTES = 1 * GiB
# What the trainer keeps between steps, beside a sleeping engine that wakes: gradients and activations are freed
# and the FP8 weight cache released, but DDP's all-reduce buckets and NCCL's buffers stay.
HELD_BETWEEN_STEPS = ("weights", "optimizer", "ddp_buckets", "nccl_buffers")
# FP8GRPOTrainer keeps its FP8 weight cache only where the training phase with it stays under this share of the GPU
# (`fp8_cache_weights=None`); the rest of the GPU covers the account's roughness (a device peak above the planned
# one: docs/contributing/engineering-notes.md, "The memory planner against the device").
FP8_CACHE_HEADROOM = 0.9
# Under FSDP2 with gradient accumulation, FP8GRPOTrainer has every micro-batch reduce-scatter its gradients
# (accelerate's sync_each_batch) where keeping them whole would put the training phase above this share of the GPU
# (the device peaked above the planner's account there: docs/contributing/engineering-notes.md, "The memory planner
# against the device").
FSDP2_GRADIENTS_HEADROOM = 0.9


def trainer_memory_bytes(
    shape: ModelShape,
    *,
    optim: str = "adamw_torch",
    fp8_training: bool = True,
    fp8_weight_cache: bool = True,
    lora: bool = False,
    micro_batch: int = 8,
    seq_len: int = 2048,
    gradient_checkpointing: bool = True,
    master_weight_bytes: int = 2,
) -> dict[str, int]:
    """A rough account of the trainer's own GPU memory on one GPU: weights, gradients, optimizer states, the FP8
    weight cache, activations of one micro-batch and its logits. Estimates, not measurements. `master_weight_bytes`:
    of each trainable weight and its gradient, 2 for BF16 masters, 4 for float32 ones (frozen weights stay BF16)."""
    if optim not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optim={optim!r} is not modelled; use one of {sorted(OPTIMIZER_STATE_BYTES)}.")
    trainable = 0 if lora else shape.params
    tokens = micro_batch * seq_len
    per_layer = tokens * (3 * shape.intermediate_size + 6 * shape.hidden_size) * 2
    if gradient_checkpointing:  # a checkpoint per layer, one layer recomputed at a time
        activations = shape.num_layers * tokens * shape.hidden_size * 2 + per_layer
    else:
        activations = shape.num_layers * per_layer
    return {
        "weights": master_weight_bytes * trainable + 2 * (shape.params - trainable),
        "gradients": master_weight_bytes * trainable,
        "optimizer": optimizer_state_bytes(shape, optim, trainable, master_weight_bytes),
        "fp8_weight_cache": shape.linear_params if fp8_training and fp8_weight_cache else 0,
        "activations": activations,
        # BF16 logits; TRL's fused log-prob kernel reads them without a float32 copy (checked: 8B training peaks)
        "logits": tokens * shape.vocab_size * 2,
    }


def optimizer_state_bytes(shape: ModelShape, optim: str, trainable: int, master_weight_bytes: int = 2) -> int:
    """The optimizer's states for `trainable` parameters held in `master_weight_bytes` each."""
    per_param = OPTIMIZER_STATE_BYTES[optim]
    if optim in DTYPE_FOLLOWING_OPTIMIZERS:
        per_param = per_param * master_weight_bytes // 2
    state = per_param * trainable
    if optim in EIGHT_BIT_OPTIMIZERS and trainable:
        state += (EMBEDDING_STATE_BYTES_8BIT - per_param) * shape.embedding_params
    return state


def training_phase_bytes(
    parts: dict[str, int],
    shape: ModelShape,
    share_bytes: float,
    *,
    sleep_mode: bool,
    max_num_seqs: int,
    cache_with_grad: bool = True,
) -> float:
    """What one GPU holds while the trainer trains: its `parts` beside vLLM's whole share, or beside what vLLM keeps
    while it sleeps (sleep mode). With `cache_with_grad=False` (FP8GRPOTrainer's default cache) the FP8 weight cache
    is held while the rollouts are scored and let go when the micro-batches start: the larger of the two."""
    vllm = vllm_overhead_bytes(shape, max_num_seqs) if sleep_mode else share_bytes
    return trainer_peak_bytes(parts, cache_with_grad=cache_with_grad) + vllm


def trainer_peak_bytes(parts: dict[str, int], *, cache_with_grad: bool = True) -> int:
    """The most the trainer itself holds while it trains (its `parts` at once, but see `training_phase_bytes` for an
    FP8 weight cache held for scoring only)."""
    if cache_with_grad or not parts.get("fp8_weight_cache"):
        return sum(parts.values())
    micro_batches = sum(v for k, v in parts.items() if k != "fp8_weight_cache")
    # Scoring: no gradients are recorded, so neither a micro-batch's activations nor the gradients (freed after each
    # optimizer step; DDP's buckets stay) are held; one chunk of logits is.
    scoring = sum(v for k, v in parts.items() if k not in ("gradients", "activations"))
    return max(micro_batches, scoring)


def keeps_fp8_weight_cache(
    parts: dict[str, int],
    shape: ModelShape,
    total: int,
    share_bytes: float,
    *,
    sleep_mode: bool,
    max_num_seqs: int,
) -> bool:
    """Whether FP8GRPOTrainer keeps its FP8 weight cache (`fp8_cache_weights=None`, which holds it for scoring only)
    for a trainer whose memory with the cache is `parts`, on a GPU of `total` bytes: the training phase with it
    stays under `FP8_CACHE_HEADROOM` of the GPU, or no higher than without it."""
    phase = functools.partial(training_phase_bytes, shape=shape, share_bytes=share_bytes, sleep_mode=sleep_mode,
                              max_num_seqs=max_num_seqs, cache_with_grad=False)  # fmt: skip
    without = phase({**parts, "fp8_weight_cache": 0})
    return phase(parts) <= max(FP8_CACHE_HEADROOM * total, without)


def trainer_memory_per_gpu(
    shape: ModelShape,
    *,
    num_processes: int = 1,
    launch: str = "ddp",
    grads_in_ddp_buckets: bool = True,
    fsdp2_prefetch_layers: int = 1,
    accumulates_gradients: bool = True,
    **memory,
) -> dict[str, int]:
    """`trainer_memory_bytes` (whose options `memory` takes) of one GPU when `num_processes` training processes, one
    per GPU, train together: DDP replicates the model, FSDP2 shards it (`launch`, ignored with one process).
    `grads_in_ddp_buckets`: DDP's `gradient_as_bucket_view`, which trl-fp8's trainers turn on
    (`FP8Tuning.ddp_gradient_as_bucket_view`) and TRL's own GRPOTrainer leaves off. `fsdp2_prefetch_layers`: the
    layers each FSDP2 unit gathers ahead (`FP8Tuning.fsdp2_prefetch_layers`; 1 is FSDP2's own).
    `accumulates_gradients`: an optimizer step takes several micro-batches (`gradient_accumulation_steps` > 1), which
    under FSDP2 keeps unsharded gradients."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}.")
    if launch not in LAUNCHES:
        raise ValueError(f"launch={launch!r} is not modelled; use one of {list(LAUNCHES)}.")
    if num_processes == 1:  # no process group: what one GPU trains with
        return trainer_memory_bytes(shape, **memory)
    if launch == "ddp":
        return _ddp_rank(trainer_memory_bytes(shape, **memory), grads_in_ddp_buckets)
    return _fsdp2_rank(shape, num_processes, memory, fsdp2_prefetch_layers, accumulates_gradients)


def _ddp_rank(parts: dict[str, int], grads_in_buckets: bool) -> dict[str, int]:
    """A DDP rank holds the whole model as one GPU does, plus DDP's all-reduce buckets (a BF16 copy of every
    gradient, allocated once and kept between steps) and NCCL's buffers. With `gradient_as_bucket_view` the
    gradients are views of the buckets: no second copy."""
    buckets = parts["gradients"]
    return {**parts, "gradients": 0 if grads_in_buckets else parts["gradients"], "ddp_buckets": buckets,
            "nccl_buffers": NCCL_BUFFER_BYTES}  # fmt: skip


def _fsdp2_rank(
    shape: ModelShape, num_processes: int, memory: dict, prefetch_layers: int = 1, accumulates_gradients: bool = True
) -> dict[str, int]:
    """An FSDP2 rank as TRL's fsdp2.yaml launches it: accelerate upcasts the trainable weights to float32 masters
    and computes in BF16; weights, gradients and optimizer states are sharded over the ranks, the units being
    computed are gathered whole in BF16 (`reshard_after_forward: true`), and trl-fp8 keeps no FP8 weight cache
    (it would undo the sharding).

    With gradient accumulation, transformers' Trainer runs every micro-batch but the last under accelerate's
    `no_sync`, which FSDP2 carries out as `set_requires_gradient_sync(False)`: no reduce-scatter, each unit's
    gradient kept whole in its reduce dtype (BF16 under accelerate's policy) until the last micro-batch reduces it.
    Every rank then holds the whole model's gradients in BF16, 2 bytes a parameter as under DDP (a device peak
    against the plan without them: docs/contributing/engineering-notes.md, "The memory planner against the
    device")."""
    parts = trainer_memory_bytes(shape, **{**memory, "fp8_weight_cache": False}, master_weight_bytes=4)
    shards = {key: math.ceil(parts[key] / num_processes) for key in ("weights", "gradients", "optimizer")}
    gathered = fsdp2_gathered_params(shape, prefetch_layers)
    trainable = 0 if memory.get("lora") else shape.params
    unsharded = 2 * trainable if accumulates_gradients else 0
    return {**parts, **shards, "unsharded_gradients": unsharded, "gathered_units": 2 * gathered,
            "nccl_buffers": NCCL_BUFFER_BYTES}  # fmt: skip


def fsdp2_gathered_params(shape: ModelShape, prefetch_layers: int = 1) -> int:
    """The most parameters an FSDP2 rank holds gathered at once, as accelerate 1.15 wraps a causal LM: each decoder
    layer is a unit, and so are the input embedding and a tail of the final norm and lm_head, which stays gathered
    from the end of forward into backward. Forward and backward prefetch the next unit while one computes (or the
    next `prefetch_layers`: `fsdp2_prefetch_layers`)."""
    layer = shape.largest_layer_params or shape.linear_params // shape.num_layers  # 0: a hand-built shape's mean
    tail = shape.embedding_params + shape.hidden_size
    if shape.tied_embeddings:  # the tail then holds the input embedding too: gathered from the first layer on
        return tail + (1 + prefetch_layers) * layer
    # the layers in flight, or the embedding (or the tail) beside the layers after (before) it
    return prefetch_layers * layer + max(layer, tail)


# --- a planned run: `trl-fp8 plan`'s arithmetic -----------------------------------------------------------------

FSDP2_OPTIM = "adamw_torch_fused"  # what trl-fp8's refusal of bitsandbytes optimizers under FSDP2 names
FITS_WITHIN = 0.97  # a run fits where its peak stays within this share of the GPU


@dataclass(frozen=True)
class PlannedRun:
    """The settings of a planned run that decide one GPU's memory (`trl-fp8 plan`'s options of the same names):
    `generation_batch` sequences per rank and rollout, `micro_batch` per forward, `fp8_cache_weights` "auto" (as
    FP8GRPOTrainer chooses it), "on" or "off"."""

    num_processes: int = 1
    vllm_gpu_memory_utilization: float = 0.3
    generation_batch: int = 128
    micro_batch: int = 8
    gradient_accumulation_steps: int | None = None
    optim: str = "adamw_torch"
    gradient_checkpointing: bool = True
    lora: bool = False
    fp8_cache_weights: str = "auto"
    sleep_mode: bool = False
    vllm_tensor_parallel_size: int = 1
    fsdp2_prefetch_layers: int = 1
    sync_each_batch: bool = False

    @classmethod
    def from_cli(cls, namespace) -> PlannedRun:
        """The run `trl-fp8 plan`'s parsed options describe."""
        names = {f.name for f in dataclasses.fields(cls)} - {"gradient_checkpointing"}
        return cls(**{name: getattr(namespace, name) for name in names},
                   gradient_checkpointing=not namespace.no_gradient_checkpointing)  # fmt: skip

    def replace(self, **changes) -> PlannedRun:
        return dataclasses.replace(self, **changes)

    def trainer_settings(self, seq_len: int) -> types.SimpleNamespace:
        """The FP8GRPOConfig fields the run's choices (`trl_fp8.plan.choices`) read (with `FP8Tuning`'s defaults),
        for FP8GRPOTrainer colocated with vLLM with importance sampling on one GPU of `num_processes` (DDP), its
        sequences sized at `seq_len` tokens: what `trl-fp8 plan` asks the trainer's own choices with."""
        cache = {"auto": None, "on": True, "off": False}[self.fp8_cache_weights]
        return types.SimpleNamespace(
            fp8_recipe="blockwise", rollout_precision="fp8", fp8_kv_cache=None, fp8_cache_weights=cache,
            use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_correction=True,
            vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            vllm_tensor_parallel_size=self.vllm_tensor_parallel_size, vllm_enable_sleep_mode=self.sleep_mode,
            vllm_max_model_length=seq_len, max_completion_length=seq_len,
            generation_batch_size=self.generation_batch * self.num_processes, world_size=self.num_processes,
            per_device_train_batch_size=self.micro_batch, gradient_accumulation_steps=self.accumulation_steps,
            gradient_checkpointing=self.gradient_checkpointing, optim=self.optim,
            fsdp="", fsdp_config=None, hf_deepspeed_config=None, device="cuda",
        )  # fmt: skip

    @property
    def engine_batch(self) -> int:
        """Sequences one engine decodes per rollout: its ranks' (TRL gathers the prompts of a tensor-parallel
        group)."""
        return self.generation_batch * self.vllm_tensor_parallel_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: as given, or TRL's default coupling (one step per rollout)."""
        return self.gradient_accumulation_steps or max(1, self.generation_batch // self.micro_batch)

    @property
    def keeps_gradients(self) -> bool:
        """Whether the micro-batches before a step's last keep their gradients unreduced (transformers' Trainer runs
        them under accelerate's `no_sync`), which FSDP2 does unsharded: not with one micro-batch a step or
        sync_each_batch."""
        return self.accumulation_steps > 1 and not self.sync_each_batch

    @property
    def cache_with_grad(self) -> bool:
        """Whether the FP8 rows' weight cache stays through the micro-batches: only "on" (fp8_cache_weights=True);
        "auto" holds it while scoring and lets it go in the micro-batches, as FP8GRPOTrainer does."""
        return self.fp8_cache_weights == "on"

    def launch_optim(self, launch: str) -> str:
        """The optimizer a launch runs: under FSDP2 a bitsandbytes optimizer is replaced by the one trl-fp8 names."""
        several = self.num_processes > 1  # (one process shards nothing: the launch is ignored)
        return FSDP2_OPTIM if several and launch == "fsdp2" and is_bitsandbytes_optimizer(self.optim) else self.optim


def peak_bytes(parts: dict[str, int], shape: ModelShape, share_bytes: float, run: PlannedRun) -> float:
    """The most the GPU holds at once. Without sleep mode vLLM keeps its share beside training. With it, training
    runs beside what vLLM cannot release, and vLLM wakes into its whole share beside what the trainer holds between
    steps: weights and optimizer states, and DDP's buckets and NCCL's buffers on several GPUs (gradients and
    activations freed, the FP8 weight cache released before the KV cache wakes)."""
    training = training_phase_bytes(parts, shape, share_bytes, sleep_mode=run.sleep_mode,
                                    max_num_seqs=run.engine_batch, cache_with_grad=run.cache_with_grad)  # fmt: skip
    if not run.sleep_mode:
        return training
    return max(training, sum(parts.get(key, 0) for key in HELD_BETWEEN_STEPS) + share_bytes)


def best_fit_share(
    parts: dict[str, int], shape: ModelShape, total: int, seq_len: int, run: PlannedRun, *, fp8_weights: bool,
    fp8_kv: bool,
) -> tuple[float, RolloutCapacity] | None:  # fmt: skip
    """`(share, capacity there)` for the largest share, in steps of 0.05, at which the run fits and vLLM has room for
    one whole sequence: what a careful user tunes `vllm_gpu_memory_utilization` to. None if no share does."""
    for step in range(19, 0, -1):
        share = step / 20
        if peak_bytes(parts, shape, share * total, run) > FITS_WITHIN * total:
            continue
        cap = rollout_capacity(shape, total, share, fp8_weights=fp8_weights, fp8_kv=fp8_kv, seq_len=seq_len,
                               max_num_seqs=run.engine_batch, tensor_parallel_size=run.vllm_tensor_parallel_size)  # fmt: skip
        return (share, cap) if cap.sequences else None
    return None


def flow_row(
    shape: ModelShape, total: int, seq_len: int, run: PlannedRun, launch: str, *, fp8_weights: bool, fp8_kv: bool,
    fetch_best: bool = True,
):  # fmt: skip
    """One flow's `(capacity, trainer memory parts of one GPU, peak per GPU, fits, best fit)` under `launch` (best
    fit None without `fetch_best`)."""
    cap = rollout_capacity(shape, total, run.vllm_gpu_memory_utilization, fp8_weights=fp8_weights, fp8_kv=fp8_kv,
                           seq_len=seq_len, max_num_seqs=run.engine_batch,
                           tensor_parallel_size=run.vllm_tensor_parallel_size)  # fmt: skip
    # The FP8 flows train with trl-fp8 (gradients in DDP's buckets by default), the BF16 one with TRL alone.
    parts = trainer_memory_per_gpu(
        shape, num_processes=run.num_processes, launch=launch, grads_in_ddp_buckets=fp8_weights,
        fsdp2_prefetch_layers=run.fsdp2_prefetch_layers if fp8_weights else 1, optim=run.launch_optim(launch),
        fp8_training=fp8_weights, lora=run.lora, micro_batch=run.micro_batch, seq_len=seq_len,
        gradient_checkpointing=run.gradient_checkpointing, accumulates_gradients=run.keeps_gradients,
    )  # fmt: skip
    share = run.vllm_gpu_memory_utilization * total
    if parts.get("fp8_weight_cache") and (
        run.fp8_cache_weights == "off"
        or run.fp8_cache_weights == "auto"  # as FP8GRPOTrainer decides at start-up (fp8_cache_weights=None)
        and not keeps_fp8_weight_cache(
            parts, shape, total, share, sleep_mode=run.sleep_mode, max_num_seqs=run.engine_batch
        )  # fmt: skip
    ):
        parts = {**parts, "fp8_weight_cache": 0}
    peak = peak_bytes(parts, shape, share, run)
    best = None
    if fetch_best:
        best = best_fit_share(parts, shape, total, seq_len, run, fp8_weights=fp8_weights, fp8_kv=fp8_kv)
    # vLLM refuses to start an engine whose KV cache cannot hold one whole sequence (its max_model_len)
    return cap, parts, peak, peak <= FITS_WITHIN * total and cap.sequences > 0, best


def fewest_fsdp2_gpus(
    shape: ModelShape, total: int, seq_len: int, run: PlannedRun, most: int, *, fp8_weights: bool, fp8_kv: bool
) -> int | None:
    """The fewest GPUs, doubling from twice `run.num_processes` up to `most`, over which FSDP2 fits the flow."""
    n = run.num_processes * 2
    while n <= most:
        more = run.replace(num_processes=n)
        if flow_row(shape, total, seq_len, more, "fsdp2", fp8_weights=fp8_weights, fp8_kv=fp8_kv, fetch_best=False)[3]:
            return n
        n *= 2
    return None
