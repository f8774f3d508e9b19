"""Rollout capacity: what a vLLM engine's memory share holds in BF16, FP8 and FP8 + FP8 KV cache, and whether the
trainer beside it fits. The arithmetic behind `trl-fp8 plan`, the engine's start-up log line and the benchmarks.

vLLM gives its KV cache what is left of `gpu_memory_utilization x GPU memory` after the weights and its own
overhead (activations of a `max_num_batched_tokens` profiling step, the sampler's logits, CUDA graphs and the CUDA
context). FP8 weights free half of the linear layers' bytes for KV cache, and an FP8 KV cache halves the bytes of
every cached token; both let more sequences decode at once.

The overhead model is empirical: `VLLM_OVERHEAD` was fitted (least squares) on vLLM 0.26.0's own KV-cache sizes for
random Qwen3 shapes (how closely it follows them: docs/when-fp8-pays.md; `tests/test_capacity.py` checks the
committed rows). Other vLLM versions and other attention kinds (sliding windows, MLA) are not modelled.

Several GPUs (`trainer_memory_per_gpu`) follow TRL's colocate mode: one training process on every GPU, and one vLLM
engine on every GPU or, with `vllm_tensor_parallel_size` T, one engine over each group of T GPUs; the trainer
replicates the model (DDP) or shards it (FSDP2, TRL's fsdp2.yaml). An engine over T GPUs holds on each of them 1/T of
the linear layers, the embedding and lm_head (vLLM's vocabulary-parallel layers) and of the key/value heads (one whole
head each where there are fewer heads than GPUs), whole norms and routers, and its overhead as the fit for one GPU
has it (not fitted for T > 1); it decodes the sequences of its T ranks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from trl_fp8.config import BLOCK  # FP8 weight blocks: one float32 scale per BLOCK x BLOCK

__all__ = [
    "FP8_CACHE_HEADROOM",
    "GPU_MEMORY_BYTES",
    "HELD_BETWEEN_STEPS",
    "LAUNCHES",
    "ModelShape",
    "RolloutCapacity",
    "expert_count",
    "keeps_fp8_weight_cache",
    "kv_bytes_per_token",
    "optimizer_state_bytes",
    "rollout_capacity",
    "fsdp2_gathered_params",
    "text_config",
    "trainer_memory_bytes",
    "trainer_memory_per_gpu",
    "trainer_peak_bytes",
    "training_phase_bytes",
    "vllm_overhead_bytes",
    "weight_bytes",
]

GiB = 2**30
# Total memory as CUDA reports it (`torch.cuda.mem_get_info()[1]`, the figure vLLM multiplies by its share): the
# H100 80GB HBM3's as CUDA reported it; the H200's is nvidia-smi's figure (on the H100, CUDA reported a little less
# than nvidia-smi: docs/engineering-notes.md, "The memory planner against the device").
GPU_MEMORY_BYTES = {"H100": 85_017_493_504, "H200": 143771 * 2**20}
KV_BLOCK_TOKENS = 16  # vLLM allocates the KV cache in blocks of 16 tokens
# overhead = base + activations x activation_factor + sampler logits x logits_factor (see vllm_overhead_bytes)
VLLM_OVERHEAD = {"base": 0.83 * GiB, "activation_factor": 1.40, "logits_factor": 0.92}
# Optimizer state bytes per trainable BF16 parameter (beyond the parameter and its gradient): AdamW keeps two
# moments in the parameter's dtype, bitsandbytes' 8-bit AdamW two 1-byte moments.
OPTIMIZER_STATE_BYTES = {"adamw_torch": 4, "adamw_torch_fused": 4, "adamw_bnb_8bit": 2, "adamw_8bit": 2,
                         "paged_adamw_8bit": 2, "adafactor": 0, "sgd": 0}  # fmt: skip
# transformers' Trainer keeps the input embedding's 8-bit AdamW states in 32 bits (two float32 moments: 8 bytes;
# docs/when-fp8-pays.md compares the estimate with a measurement).
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
# one: docs/engineering-notes.md, "The memory planner against the device").
FP8_CACHE_HEADROOM = 0.9
# Under FSDP2 with gradient accumulation, FP8GRPOTrainer has every micro-batch reduce-scatter its gradients
# (accelerate's sync_each_batch) where keeping them whole would put the training phase above this share of the GPU
# (the device peaked above the planner's account there: docs/scaling.md, "Launching on one machine", FSDP2 and
# gradient accumulation).
FSDP2_GRADIENTS_HEADROOM = 0.9


# How transformers' mixture-of-experts configs name their routed-expert count, across families
EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts")


def text_config(config):
    """The decoder's config: a multimodal config's text model's, else the config itself (transformers objects)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def expert_count(config) -> int:
    """Routed experts per MoE layer of a transformers config object (its text model's), 0 for a dense decoder."""
    text = text_config(config)
    return next((n for name in EXPERT_COUNT_NAMES if (n := getattr(text, name, None))), 0)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its memory: parameters that FP8 stores in 1 byte (the
    linear layers of attention and MLP or experts) and those that stay 16-bit (embeddings, lm_head, norms, routers)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's, or one expert's for a mixture of experts
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    linear_params: int
    other_params: int
    largest_layer_params: int = 0  # the biggest decoder layer's, what FSDP2 gathers at once (0: not known)
    tied_embeddings: bool = False

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    @property
    def embedding_params(self) -> int:
        """The input embedding's (an `nn.Embedding`, whatever the lm_head)."""
        return self.vocab_size * self.hidden_size

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (object or dict; a multimodal model's `text_config` is used).

        Raises ValueError naming what it cannot model: a missing field, or an attention kind other than grouped
        query attention (e.g. DeepSeek's MLA)."""
        c = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        c = c.get("text_config") or c
        name = c.get("model_type", "this model")
        if c.get("kv_lora_rank"):
            raise ValueError(f"{name} uses multi-head latent attention (MLA), which the planner does not model.")

        def need(*keys):
            for key in keys:
                if c.get(key) is not None:
                    return c[key]
            raise ValueError(f"The {name} config has no {' / '.join(keys)}: the planner cannot size it.")

        hidden, layers, vocab = need("hidden_size"), need("num_hidden_layers"), need("vocab_size")
        heads = need("num_attention_heads")
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or hidden // heads
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        if experts:  # a mixture of experts: every MoE layer holds all experts (3 projections each) and a router
            expert_dim = need("moe_intermediate_size", "intermediate_size")
            shared = c.get("shared_expert_intermediate_size") or 0
            dense_only = set(c.get("mlp_only_layers") or [])
            step = c.get("decoder_sparse_step") or 1
            moe_layers = [i for i in range(layers) if i not in dense_only and (i + 1) % step == 0]
            dense_dim = c.get("intermediate_size") or expert_dim
            mlp = len(moe_layers) * (3 * hidden * (experts * expert_dim + shared)) + (layers - len(moe_layers)) * (
                3 * hidden * dense_dim
            )
            layer_router = hidden * (experts + (1 if shared else 0))
            router = len(moe_layers) * layer_router
            intermediate = expert_dim
            moe_mlp = 3 * hidden * (experts * expert_dim + shared) + layer_router
            largest_mlp = max(moe_mlp if moe_layers else 0, 3 * hidden * dense_dim if len(moe_layers) < layers else 0)
        else:
            intermediate = need("intermediate_size")
            mlp, router = layers * 3 * hidden * intermediate, 0
            largest_mlp = 3 * hidden * intermediate
        tied = bool(c.get("tie_word_embeddings"))
        embeddings = vocab * hidden * (1 if tied else 2)
        layer_norms = 2 * hidden + 2 * head_dim  # input and post-attention norms; q and k norms
        norms = layers * layer_norms + hidden
        return cls(layers, hidden, intermediate, vocab, kv_heads, head_dim, layers * attention + mlp,
                   embeddings + norms + router, attention + largest_mlp + layer_norms, tied)  # fmt: skip


def weight_bytes(shape: ModelShape, fp8: bool, tensor_parallel_size: int = 1) -> int:
    """Bytes of the weights in vLLM on one GPU of an engine over `tensor_parallel_size` GPUs: BF16 everywhere, or FP8
    linear layers (plus a float32 scale per 128x128 block) beside 16-bit embeddings, lm_head and norms. The linear
    layers and the vocabulary-parallel embedding and lm_head split over the GPUs; norms and routers stay whole."""
    tp = tensor_parallel_size
    vocab = shape.embedding_params * (1 if shape.tied_embeddings else 2)
    whole = 2 * (shape.other_params - vocab)
    linear = shape.linear_params
    if fp8:
        linear = linear + 4 * math.ceil(linear / BLOCK**2)
    else:
        linear = 2 * linear
    return math.ceil(linear / tp) + math.ceil(2 * vocab / tp) + whole


def kv_bytes_per_token(shape: ModelShape, fp8_kv: bool, tensor_parallel_size: int = 1) -> int:
    """KV-cache bytes of one token on one GPU: K and V of every layer for its key/value heads (1/T of them, at least
    one: vLLM replicates heads it cannot split), 1 byte an element in FP8, 2 in BF16."""
    heads = max(1, shape.num_kv_heads // tensor_parallel_size)
    return shape.num_layers * 2 * heads * shape.head_dim * (1 if fp8_kv else 2)


def vllm_overhead_bytes(shape: ModelShape, max_num_seqs: int, max_num_batched_tokens: int = 4096) -> int:
    """What vLLM keeps of its share besides weights and KV cache (the fitted model in the module docstring): a fixed
    part, the activations of a `max_num_batched_tokens` step through one layer, and float32 logits for
    `max_num_seqs` sequences."""
    activations = max_num_batched_tokens * (2 * shape.intermediate_size + 4 * shape.hidden_size) * 2
    logits = max_num_seqs * shape.vocab_size * 4
    o = VLLM_OVERHEAD
    return int(o["base"] + o["activation_factor"] * activations + o["logits_factor"] * logits)


@dataclass(frozen=True)
class RolloutCapacity:
    """What one vLLM engine holds: bytes of weights, of a cached token, the KV tokens and whole sequences at once."""

    weight_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    sequences: int  # of `seq_len` tokens that decode at once (at most max_num_seqs)
    seq_len: int

    def waves(self, batch: int) -> int:
        """Rounds of decoding for `batch` sequences (1: every sequence fits at once)."""
        return math.ceil(batch / self.sequences) if self.sequences else 0


def rollout_capacity(
    shape: ModelShape,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float,
    *,
    fp8_weights: bool,
    fp8_kv: bool,
    seq_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int = 4096,
    tensor_parallel_size: int = 1,
) -> RolloutCapacity:
    """Estimate the engine's KV cache (vLLM's "GPU KV cache size") and how many `seq_len`-token sequences decode at
    once, for a share `gpu_memory_utilization` of `gpu_memory_bytes` on each of its `tensor_parallel_size` GPUs (the
    weight and KV bytes are one GPU's; each GPU caches its heads of every token, so the tokens are the engine's)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
    weights = weight_bytes(shape, fp8_weights, tensor_parallel_size)
    per_token = kv_bytes_per_token(shape, fp8_kv, tensor_parallel_size)
    free = gpu_memory_utilization * gpu_memory_bytes - weights
    free -= vllm_overhead_bytes(shape, max_num_seqs, max_num_batched_tokens)
    tokens = max(0, int(free // per_token)) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
    return RolloutCapacity(weights, per_token, tokens, min(max_num_seqs, tokens // seq_len), seq_len)


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
    `grads_in_ddp_buckets`: DDP's `gradient_as_bucket_view`, which trl-fp8's FP8GRPOConfig turns on
    (`ddp_gradient_as_bucket_view`) and TRL's own GRPOTrainer leaves off. `fsdp2_prefetch_layers`: the layers each
    FSDP2 unit gathers ahead (the FP8 configs' option; 1 is FSDP2's own). `accumulates_gradients`: an optimizer step
    takes several micro-batches (`gradient_accumulation_steps` > 1), which under FSDP2 keeps unsharded gradients."""
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
    against the plan without them: docs/scaling.md, "Launching on one machine", FSDP2 and gradient accumulation)."""
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
