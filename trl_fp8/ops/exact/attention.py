"""Causal self-attention over packed sequences, with the engine's kernel forward.

The engine decodes each token with FlashAttention-3 over its paged KV cache, one split (vLLM's batch-invariant
mode); with one split each row walks the keys in a fixed order, so the prefill of a whole sequence gives every row
the bits its decode gave (`tests/gpu/test_exactness_gates_gpu.py`). The trainer calls that kernel on its packed
sequences. FlashAttention-3 as vLLM builds it has no backward: the gradient recomputes the attention with PyTorch's
own and differentiates that (one more forward per layer). On the GPU that is PyTorch's variable-length FlashAttention
(`torch.nn.attention.varlen.varlen_attn`), every sequence of the pack and every query head of a group in one call;
elsewhere, `scaled_dot_product_attention` a sequence at a time. Not SDPA on the GPU: in exact mode vLLM's
batch-invariant mode puts its Triton kernels in place of `aten::bmm` and softmax for the whole process, and at 8B the
profile showed SDPA's grouped-query backward on them (six bmm launches per sequence and layer, 2.2 s a GRPO step).

With an FP8 KV cache (`scales`: the layer's query, key and value scales as the engine holds them) the engine stores
`k / k_scale` and `v / v_scale` in float8_e4m3fn, feeds FlashAttention-3 the query as `q / q_scale` in FP8 too, and
descales inside the kernel; the trainer quantizes with the engine's kernels and calls the same one. The gradient is
still the BF16 attention's (the rounding to FP8 passes the gradient straight through, as in the linear layers).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trl_fp8.quantization import FP8_DTYPE, FP8_MAX

# kernel(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], cu_seqlens [B + 1] int32, max_seqlen, softmax_scale,
#        scales=None | (q_scale, k_scale, v_scale)) -> [T, Hq, D]
AttentionKernel = Callable[..., torch.Tensor]


def _per_sequence(cu_seqlens: torch.Tensor):
    bounds = cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _sdpa(q, k, v, softmax_scale):
    """One sequence [L, H, D], causal, grouped-query: PyTorch's attention."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` as an FP8 cache holds it, read back in float32: `x / scale` saturated to e4m3's range and rounded to
    float8_e4m3fn, times `scale`."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale.float()


def reference_attention(q, k, v, cu_seqlens, max_seqlen, softmax_scale, scales=None):
    """Each sequence of the pack attended alone, in float32, rounded once; with `scales` (q, k, v), over the
    values an FP8 cache and an FP8 query hold."""
    out = torch.empty_like(q)
    if scales is not None:
        q, k, v = (fp8_round_trip(x, scale) for x, scale in zip((q, k, v), scales, strict=True))
    for part in _per_sequence(cu_seqlens):
        out[part] = _sdpa(q[part].float(), k[part].float(), v[part].float(), softmax_scale).to(out.dtype)
    return out


@functools.cache  # asked at every layer's backward: import and read the signature once
def _varlen_flash():
    """PyTorch's variable-length FlashAttention where it takes grouped-query heads (torch 2.13; vLLM 0.31, which exact
    mode needs, pins it), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "enable_gqa" in inspect.signature(varlen_attn).parameters else None


def attention_gradients(q, k, v, grad, cu_seqlens, max_seqlen, softmax_scale):
    """The gradients to `q`, `k` and `v` of causal attention over the packed sequences, for the output's gradient
    `grad`: one variable-length FlashAttention call for the pack on a CUDA device (bf16/fp16), else PyTorch's SDPA
    a sequence at a time."""
    varlen_attn = _varlen_flash()
    with torch.enable_grad():
        if varlen_attn is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            inputs = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]  # FlashAttention's layout
            cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
            out = varlen_attn(*inputs, cu, cu, max_seqlen, max_seqlen, scale=softmax_scale, window_size=(-1, 0),
                              enable_gqa=True)  # fmt: skip
            return torch.autograd.grad(out, inputs, grad.contiguous())
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for part in _per_sequence(cu_seqlens):
            pieces = [t[part] for t in inputs]
            parts = torch.autograd.grad(_sdpa(*pieces, softmax_scale), pieces, grad[part])
            for whole, piece in zip(grads, parts, strict=True):
                whole[part] = piece
        return grads


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, kernel, scales):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.softmax_scale = softmax_scale
        ctx.max_seqlen = max_seqlen
        return kernel(q, k, v, cu_seqlens, max_seqlen, softmax_scale, scales=scales)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_seqlens = ctx.saved_tensors
        grads = attention_gradients(q, k, v, grad, cu_seqlens, ctx.max_seqlen, ctx.softmax_scale)
        return *grads, None, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    softmax_scale: float,
    kernel: AttentionKernel = reference_attention,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of the sequences packed in `q [T, Hq, D]`, `k`, `v [T, Hk, D]` (sequence i at rows
    `cu_seqlens[i]:cu_seqlens[i + 1]`) as `kernel` computes it, over an FP8 KV cache where `scales` gives the
    layer's (q_scale, k_scale, v_scale); gradients to q, k and v."""
    return _Attention.apply(q, k, v, cu_seqlens, max_seqlen, softmax_scale, kernel, scales)
