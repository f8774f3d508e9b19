"""Causal self-attention over packed sequences, with the engine's kernel forward.

The engine decodes each token with FlashAttention-3 over its paged KV cache, one split (vLLM's batch-invariant
mode); with one split each row walks the keys in a fixed order, so the prefill of a whole sequence gives every row
the bits its decode gave (`tests/gpu/test_exactness_gates_gpu.py`). The trainer calls that kernel on its packed
sequences. FlashAttention-3 as vLLM builds it has no backward: the gradient recomputes the attention with PyTorch's
`scaled_dot_product_attention` (one more forward per layer) and differentiates that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# kernel(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], cu_seqlens [B + 1] int32, max_seqlen, softmax_scale) -> [T, Hq, D]
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


def reference_attention(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
    """Each sequence of the pack attended alone, in float32, rounded once."""
    out = torch.empty_like(q)
    for part in _per_sequence(cu_seqlens):
        out[part] = _sdpa(q[part].float(), k[part].float(), v[part].float(), softmax_scale).to(q.dtype)
    return out


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, softmax_scale, kernel):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.softmax_scale = softmax_scale
        return kernel(q, k, v, cu_seqlens, max_seqlen, softmax_scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_seqlens = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for part in _per_sequence(cu_seqlens):
            with torch.enable_grad():
                inputs = [t[part].detach().requires_grad_() for t in (q, k, v)]
                out = _sdpa(*inputs, ctx.softmax_scale)
                parts = torch.autograd.grad(out, inputs, grad[part])
            for whole, piece in zip(grads, parts, strict=True):
                whole[part] = piece
        return *grads, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    softmax_scale: float,
    kernel: AttentionKernel = reference_attention,
) -> torch.Tensor:
    """Causal attention of the sequences packed in `q [T, Hq, D]`, `k`, `v [T, Hk, D]` (sequence i at rows
    `cu_seqlens[i]:cu_seqlens[i + 1]`) as `kernel` computes it; gradients to q, k and v."""
    return _Attention.apply(q, k, v, cu_seqlens, max_seqlen, softmax_scale, kernel)
