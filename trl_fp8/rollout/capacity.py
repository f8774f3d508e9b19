"""Rollout capacity: what a vLLM engine's memory share holds in BF16, FP8 and FP8 + FP8 KV cache, and whether the
engine's start-up log line, `trl-fp8 plan` and the benchmarks read it. The trainer's side of a GPU (what training
holds beside the engine, on one GPU or several) is `trl_fp8.plan.memory`.

vLLM gives its KV cache what is left of `gpu_memory_utilization x GPU memory` after the weights and its own
overhead (activations of a `max_num_batched_tokens` profiling step, the sampler's logits, CUDA graphs and the CUDA
context). FP8 weights free half of the linear layers' bytes for KV cache, and an FP8 KV cache halves the bytes of
every cached token; both let more sequences decode at once.

The overhead model is empirical: `VLLM_OVERHEAD` was fitted (least squares) on vLLM 0.26.0's own KV-cache sizes for
random Qwen3 shapes (how closely it follows them: docs/contributing/when-fp8-pays-details.md; `tests/test_capacity.py`
checks the committed rows). Other vLLM versions and other attention kinds (sliding windows, MLA) are not modelled.

Several GPUs follow TRL's colocate mode: one vLLM engine on every GPU or, with `vllm_tensor_parallel_size` T, one
engine over each group of T GPUs. An engine over T GPUs holds on each of them 1/T of
the linear layers, the embedding and lm_head (vLLM's vocabulary-parallel layers) and of the key/value heads (one whole
head each where there are fewer heads than GPUs), whole norms and routers, and its overhead as the fit for one GPU
has it (not fitted for T > 1); it decodes the sequences of its T ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trl_fp8.config import BLOCK  # FP8 weight blocks: one float32 scale per BLOCK x BLOCK

__all__ = [
    "GPU_MEMORY_BYTES",
    "ModelShape",
    "RolloutCapacity",
    "expert_count",
    "kv_bytes_per_token",
    "rollout_capacity",
    "text_config",
    "vllm_overhead_bytes",
    "weight_bytes",
]

GiB = 2**30
# Total memory as CUDA reports it (`torch.cuda.mem_get_info()[1]`, the figure vLLM multiplies by its share): the
# H100 80GB HBM3's as CUDA reported it; the H200's is nvidia-smi's figure (on the H100, CUDA reported a little less
# than nvidia-smi: docs/contributing/engineering-notes.md, "The memory planner against the device").
GPU_MEMORY_BYTES = {"H100": 85_017_493_504, "H200": 143771 * 2**20}
KV_BLOCK_TOKENS = 16  # vLLM allocates the KV cache in blocks of 16 tokens
# overhead = base + activations x activation_factor + sampler logits x logits_factor (see vllm_overhead_bytes)
VLLM_OVERHEAD = {"base": 0.83 * GiB, "activation_factor": 1.40, "logits_factor": 0.92}


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
