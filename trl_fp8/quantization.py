"""Blockwise and groupwise FP8 (e4m3) quantizers: the reference math shared by training, emulation and export.

Convention (vLLM / transformers block-FP8 checkpoints, DeepSeek-V3): a tensor `x` is stored as `q` in
`float8_e4m3fn` and a float32 `scale_inv` per block, with `x ~= q * scale_inv` and `scale_inv = amax / 448`.

The arithmetic mirrors torchao's blockwise Triton kernels step by step (amax clamped at 1e-12 in the input dtype,
scale `448 / amax` computed in float64 then rounded to float32, `x * scale` in float32, saturating cast, stored
reciprocal `1 / scale` in float32), so this pure-torch code and the GPU kernels produce the same bits; a GPU test
checks it. The CPU emulation, the vLLM weight sync and the exporter all call these functions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
EPS = 1e-12  # torchao's kernels clamp amax here; all-zero blocks get a finite (huge) scale and q == 0

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "quantize_blocks",
    "dequantize_blocks",
    "quantize_groups",
    "dequantize_groups",
]


def _scale_from_amax(amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    """Quantization multiplier 448 / amax, float32 (rounded down to a power of two if asked)."""
    amax = amax.clamp(min=EPS).to(torch.float64)
    scale = (FP8_MAX / amax).to(torch.float32)
    if power_of_two:
        # Round down, never up: a larger scale would push the block's amax past 448 and saturate it.
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _cast_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)


def quantize_blocks(
    w: torch.Tensor, block_size: tuple[int, int] = (128, 128), *, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to FP8 in `block_size` tiles.

    Args:
        w: `[N, K]` weight in any floating dtype. Dims need not be multiples of the block; edge blocks are partial
            (what vLLM expects for `ceil` scale shapes).
        block_size: `(rows, cols)` of a tile, `(128, 128)` for vLLM/DeepSeek checkpoints.
        power_of_two_scales: round scales down to powers of two.

    Returns:
        `(q, scale_inv)`: `q` float8_e4m3fn `[N, K]` (contiguous), `scale_inv` float32 `[ceil(N/bn), ceil(K/bk)]`,
        the dequantization multiplier (block amax / 448), i.e. vLLM's `weight_scale_inv`.
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_blocks expects a 2-D weight, got shape {tuple(w.shape)}.")
    if not w.is_floating_point() or w.dtype == FP8_DTYPE:
        raise TypeError(f"quantize_blocks expects a high-precision floating tensor, got {w.dtype}.")
    bn, bk = block_size
    n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    # Zero padding never changes a block's amax, so partial edge blocks need no special case.
    padded = F.pad(w, (0, kb * bk - k, 0, nb * bn - n)) if (n % bn or k % bk) else w
    blocks = padded.reshape(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = _scale_from_amax(amax, power_of_two_scales)
    q = _cast_to_fp8(blocks, scale[:, None, :, None]).reshape(nb * bn, kb * bk)
    if q.shape != w.shape:
        q = q[:n, :k].contiguous()
    return q, 1.0 / scale


def dequantize_blocks(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: `q * scale_inv` broadcast over each tile, in `dtype`."""
    bn, bk = block_size
    n, k = q.shape
    expected = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match {expected} for q {tuple(q.shape)}.")
    full = scale_inv.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    return (q.to(torch.float32) * full).to(dtype)


def quantize_groups(
    x: torch.Tensor, group_size: int = 128, *, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last (reduction) dim in 1 x `group_size` groups, one scale per token and group.

    Used for activations and output gradients. Returns `(q, scale_inv)` with `q` float8_e4m3fn of `x`'s shape and
    `scale_inv` float32 of shape `[..., K / group_size]`, same convention as :func:`quantize_blocks`.
    """
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(f"Last dim {k} is not a multiple of the group size {group_size}.")
    groups = x.reshape(*x.shape[:-1], k // group_size, group_size)
    scale = _scale_from_amax(groups.abs().amax(dim=-1), power_of_two_scales)
    q = _cast_to_fp8(groups, scale[..., None]).reshape(x.shape)
    return q, 1.0 / scale


def dequantize_groups(
    q: torch.Tensor, scale_inv: torch.Tensor, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`."""
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size).to(torch.float32)
    return (groups * scale_inv[..., None]).reshape(q.shape).to(dtype)
