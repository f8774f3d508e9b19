"""Floors of the training-side benchmarks: the least time the GPU's data-sheet peaks allow for the work a row does,
so each measured time is reported as a fraction of what the hardware could do (`bench_linear`, `bench_train_step`).

What a floor counts, per linear layer forward + backward on `m` tokens (`y = x @ W.T`, `x [m, k]`, `W [n, k]`):

- the three GEMMs (FProp, DGrad, WGrad), each `2 m k n` FLOPs at the tensor-core peak of its precision, or its
  operands' bytes at HBM bandwidth where those take longer (small `m`): FP8 operands are 1 byte, outputs BF16;
- in FP8, the quantization passes, memory-bound: `x` read once (BF16) and written in both FP8 layouts with their
  float32 scales, the same for `dy`, and for each quantization of `W` its BF16 read and FP8 write (the forward's,
  unless a cached copy is reused, and DGrad's re-quantization).

The kernels run one after another on one stream, so their floors add up. Not counted: anything a BF16 flow runs as
well (norms, RoPE, SwiGLU, softmax cross-entropy, the optimizer), so a training step's floor is that of its GEMMs,
attention and FP8 quantization, a lower bound on both flows.
"""

from __future__ import annotations

from benchmarks.bench_rollout import HEAD_DIM

BLOCK = 128  # 1x128 groups and 128x128 blocks: one float32 scale each


def gemm_floor_s(m: int, k: int, n: int, fp8: bool, hw: dict) -> float:
    """`[m, k] @ [k, n]`: its FLOPs at the peak, or its operand and output bytes at HBM bandwidth, whichever is more."""
    operand = 1 if fp8 else 2
    flops = 2 * m * k * n / hw["fp8" if fp8 else "bf16"]
    moved = ((m * k + k * n) * operand + 2 * m * n) / hw["hbm"]
    return max(flops, moved)


def backward_gemms_floor_s(m: int, k: int, n: int, fp8: bool, hw: dict) -> float:
    """DGrad (`dy [m, n] @ W [n, k]`) and WGrad (`dy.T [n, m] @ x [m, k]`) of the GEMM `[m, k] @ [k, n]`."""
    return gemm_floor_s(m, n, k, fp8, hw) + gemm_floor_s(n, m, k, fp8, hw)


def act_quant_bytes(m: int, k: int) -> float:
    """One activation quantized into both layouts (1x128 groups along `k` and along tokens): a BF16 read, two FP8
    writes and their scales."""
    return 2 * m * k + 2 * m * k + 2 * 4 * m * k / BLOCK


def weight_quant_bytes(n: int, k: int) -> float:
    """One weight quantized into 128x128 blocks: a BF16 read, an FP8 write and its scales."""
    return 2 * n * k + n * k + 4 * n * k / BLOCK**2


def linear_floor_s(m: int, k: int, n: int, fp8: bool, hw: dict, weight_quantizations: int = 2) -> float:
    """Forward + backward of one linear layer (or of layers reading one input, `n` their summed outputs).
    `weight_quantizations`: 2 when the forward quantizes `W` and DGrad re-quantizes it, 1 with a cached forward copy,
    0 when DGrad also multiplies by the cached copy (a sibling group's)."""
    gemms = gemm_floor_s(m, k, n, fp8, hw) + backward_gemms_floor_s(m, k, n, fp8, hw)
    if not fp8:
        return gemms
    quant = act_quant_bytes(m, k) + act_quant_bytes(m, n) + weight_quantizations * weight_quant_bytes(n, k)
    return gemms + quant / hw["hbm"]


def decoder_linears(shape: dict) -> list[tuple[int, int]]:
    """`(k, n)` of a dense Qwen3 decoder layer's linear groups, as each input is quantized once: q/k/v, o, gate/up,
    down."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * HEAD_DIM, shape["num_key_value_heads"] * HEAD_DIM
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def train_step_floor_s(
    shape: dict, layers: int, batch: int, seq_len: int, micro_batches: int, fp8: bool, hw: dict,
    checkpoint_every_n: int = 1, weight_cache: bool = True, dgrad_requantizes: bool = True,
) -> dict:  # fmt: skip
    """The floor of `bench_train_step`'s optimizer step: `micro_batches` forward + backward passes of `batch`
    sequences of `seq_len` tokens through `layers` dense decoder layers and the BF16 `lm_head`, with the layers
    under gradient checkpointing (`checkpoint_every_n`: every n-th layer's forward runs again in the backward; 0:
    none). `weight_cache`: the forward's FP8 weights are quantized once per optimizer step (the layers' cache),
    else at every forward. `dgrad_requantizes`: False where DGrad multiplies by the forward's cached copy (sibling
    groups). Returns the floor and its parts, in seconds."""
    m = batch * seq_len
    groups = decoder_linears(shape)
    r = (0 if checkpoint_every_n == 0 else layers // checkpoint_every_n) / layers  # share of forwards run twice
    fprop = sum(gemm_floor_s(m, k, n, fp8, hw) for k, n in groups)
    dgrad_wgrad = sum(backward_gemms_floor_s(m, k, n, fp8, hw) for k, n in groups)
    linear = layers * ((1 + r) * fprop + dgrad_wgrad)
    # causal attention: QK^T and PV over half of the seq_len x seq_len scores; the backward twice the forward
    attention = (3 + r) * layers * batch * 2 * seq_len**2 * shape["num_attention_heads"] * HEAD_DIM / hw["bf16"]
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    lm_head = gemm_floor_s(m, h, vocab, False, hw) + backward_gemms_floor_s(m, h, vocab, False, hw)
    quant = 0.0
    if fp8:
        # each linear input in every forward (recomputed ones too), each output gradient once; the weights: the
        # forward's copy (once per optimizer step with the cache, else at every forward) and DGrad's re-quantization
        weights = (1 / micro_batches if weight_cache else 1 + r) + dgrad_requantizes
        quant = layers * sum((1 + r) * act_quant_bytes(m, k) + act_quant_bytes(m, n)
                             + weights * weight_quant_bytes(n, k) for k, n in groups) / hw["hbm"]  # fmt: skip
    per_micro_batch = linear + attention + lm_head + quant
    return {
        "floor_s": micro_batches * per_micro_batch,
        "linear_gemms_s": micro_batches * linear,
        "attention_s": micro_batches * attention,
        "lm_head_s": micro_batches * lm_head,
        "fp8_quantization_s": micro_batches * quant,
    }
