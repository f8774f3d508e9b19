"""Rotary position embedding of queries and keys, with the engine's kernel forward and the engine's table.

vLLM rotates q and k in place from one `cos_sin_cache [max_position, rotary_dim]` (cosines, then sines) that it
computes once on the GPU in the model's dtype; Hugging Face recomputes cos and sin at every forward, another
rounding. The trainer reads the engine's table and calls its kernel (NeoX layout: the two halves of each head
rotate together, as Qwen3 and Llama do).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# kernel(positions [T], q [T, Hq * D], k [T, Hk * D], head_size, cos_sin_cache, is_neox) rotating q and k in place
# (vLLM's `_custom_ops.rotary_embedding`: they are clones here)
RotaryKernel = Callable[..., object]


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    return cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, rotary_dim / 2]: one angle per pair, every head


def _rotate(x: torch.Tensor, head_size: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H * D] rotated by (cos, sin) over each head's first `2 * cos.shape[-1]` dims, in float32."""
    heads = x.float().reshape(x.shape[0], -1, head_size)
    half = cos.shape[-1]
    x1, x2, rest = heads[..., :half], heads[..., half : 2 * half], heads[..., 2 * half :]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return rotated.reshape(x.shape)


def reference_rotary(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """Rotates `query` and `key` in place as vLLM's kernel does (float32 arithmetic, rounded once)."""
    if not is_neox:
        raise NotImplementedError("only the NeoX rotary layout (Qwen3, Llama) is implemented")
    cos, sin = _cos_sin(positions, cos_sin_cache)
    query.copy_(_rotate(query, head_size, cos, sin))
    key.copy_(_rotate(key, head_size, cos, sin))


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, positions, query, key, head_size, cos_sin_cache, kernel):
        q, k = query.clone(), key.clone()
        kernel(positions, q, k, head_size, cos_sin_cache, True)
        ctx.save_for_backward(positions, cos_sin_cache)
        ctx.head_size = head_size
        return q, k

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        positions, cos_sin_cache = ctx.saved_tensors
        cos, sin = _cos_sin(positions, cos_sin_cache)
        # a rotation's gradient is the inverse rotation
        back = [None if g is None else _rotate(g, ctx.head_size, cos, -sin).to(g.dtype) for g in (grad_q, grad_k)]
        return None, back[0], back[1], None, None, None


def rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    kernel: RotaryKernel = reference_rotary,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`query [T, Hq * D]` and `key [T, Hk * D]` rotated by `kernel` at `positions [T]` from `cos_sin_cache`
    (query and key are left as they were); gradients to both."""
    return _Rotary.apply(positions, query, key, head_size, cos_sin_cache, kernel)
