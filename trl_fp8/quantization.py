"""Blockwise and groupwise FP8 (e4m3) quantizers: the reference math shared by training, emulation and export.

Convention (vLLM / transformers block-FP8 checkpoints, DeepSeek-V3): a tensor `x` is stored as `q` in
`float8_e4m3fn` and a float32 `scale_inv` per block, with `x ~= q * scale_inv` and `scale_inv = amax / 448`.

The arithmetic is written once here and step for step in the Triton kernels (`trl_fp8.kernels`): amax in float32
(exact for BF16 inputs) clamped at 1e-12, scale `448 / amax` computed in float64 then rounded to float32, `x * scale`
in float32, saturating cast, stored reciprocal `1 / scale` in float32. So this pure-torch code and the kernels produce
the same bits (tests check it on the GPU, and on CPU through Triton's interpreter). The CPU emulation, the vLLM
weight sync and the exporter all call these functions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from trl_fp8.config import BLOCK

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format of every weight, activation and gradient: e4m3 (4 exponent bits, 3 mantissa bits, no infinity)."""
FP8_MAX = torch.finfo(FP8_DTYPE).max
"""The largest e4m3 value, 448.0: a block's amax is scaled onto it."""
EPS = 1e-12  # amax floor (float32): all-zero groups get a finite (huge) scale and q == 0

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "quantize_blocks",
    "dequantize_blocks",
    "quantize_groups",
    "dequantize_groups",
    "QuantizedAct",
    "quantize_act_layouts",
    "quantize_swiglu_layouts",
]


def _scale_from_amax(amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    """Quantization multiplier 448 / amax, float32 (rounded down to a power of two if asked)."""
    amax = amax.to(torch.float32).clamp(min=EPS).to(torch.float64)
    scale = (FP8_MAX / amax).to(torch.float32)
    if power_of_two:
        # Round down, never up: a larger scale would push the block's amax past 448 and saturate it. Clearing the
        # mantissa bits is exact (a float32 log2 can round 2**k * (1 - 2**-24) up to k); the kernels do the same.
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def _cast_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)


def quantize_blocks(
    w: torch.Tensor, block_size: tuple[int, int] = (BLOCK, BLOCK), *, power_of_two_scales: bool = False
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
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_blocks`: `q * scale_inv` broadcast over each tile, in `dtype`."""
    bn, bk = block_size
    n, k = q.shape
    expected = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match {expected} for q {tuple(q.shape)}.")
    full = scale_inv.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    return (q.to(torch.float32) * full).to(dtype)


def quantize_groups(
    x: torch.Tensor, group_size: int = BLOCK, *, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last (reduction) dim in 1 x `group_size` groups, one scale per token and group.

    Used for activations and output gradients. Returns `(q, scale_inv)` with `q` float8_e4m3fn of `x`'s shape and
    `scale_inv` float32 of shape `[..., K / group_size]`, same convention as `quantize_blocks`.
    """
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(f"Last dim {k} is not a multiple of the group size {group_size}.")
    groups = x.reshape(*x.shape[:-1], k // group_size, group_size)
    scale = _scale_from_amax(groups.abs().amax(dim=-1), power_of_two_scales)
    q = _cast_to_fp8(groups, scale[..., None]).reshape(x.shape)
    return q, 1.0 / scale


def dequantize_groups(
    q: torch.Tensor, scale_inv: torch.Tensor, group_size: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_groups`."""
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size).to(torch.float32)
    return (groups * scale_inv[..., None]).reshape(q.shape).to(dtype)


class QuantizedAct(NamedTuple):
    """The FP8 operands of one activation or output gradient `x [M, K]`; `None` for a layout not asked for.

    `M_pad` is the token count rounded up to 128, padded with zero tokens (WGrad sums over tokens in 128-groups).
    """

    q: torch.Tensor | None  # [M_pad, K]: groups along K (FProp and DGrad's A operand)
    scale_inv: torch.Tensor | None  # [M_pad, K / 128]
    qt: torch.Tensor | None  # [K, M_pad]: x.T in groups along tokens (WGrad's operands)
    scale_inv_t: torch.Tensor | None  # [K, M_pad / 128]

    def as_op_outputs(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A `torch.library` op returns tensors only: an absent layout becomes an empty placeholder."""
        return tuple(t if t is not None else like.new_empty(0) for t in self)

    @classmethod
    def from_op_outputs(cls, out, rows: bool, cols: bool) -> QuantizedAct:
        """The inverse of `as_op_outputs`, knowing which layouts were asked for."""
        q, s, qt, st = out
        return cls(q if rows else None, s if rows else None, qt if cols else None, st if cols else None)


def quantize_act_layouts(
    x: torch.Tensor, *, rows: bool = True, cols: bool = False, power_of_two_scales: bool = False
) -> QuantizedAct:
    """Reference for `trl_fp8.kernels.quantize_act`: a 2-D `x [M, K]` zero-padded to a multiple of 128 tokens, then
    quantized in 1x128 groups along K (`rows`) and along tokens (`cols`)."""
    pad = -x.shape[0] % BLOCK
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    q = s = qt = st = None
    if rows:
        q, s = quantize_groups(x, BLOCK, power_of_two_scales=power_of_two_scales)
    if cols:
        qt, st = quantize_groups(x.t(), BLOCK, power_of_two_scales=power_of_two_scales)
    return QuantizedAct(q, s, qt, st)


def quantize_swiglu_layouts(
    gate: torch.Tensor, up: torch.Tensor, *, rows: bool = True, cols: bool = False, power_of_two_scales: bool = False
) -> QuantizedAct:
    """Reference for `trl_fp8.kernels.quantize_swiglu`: the gated MLP's `silu(gate) * up`, computed as eager PyTorch
    does (each op's result rounded to the input dtype), then quantized as `quantize_act_layouts`."""
    return quantize_act_layouts(F.silu(gate) * up, rows=rows, cols=cols, power_of_two_scales=power_of_two_scales)
