"""Real FP8 kernels on Hopper: our Triton quantizers (`trl_fp8.kernels`) and cuBLAS blockwise `F.scaled_mm`.

The quantizers compute the same bits as `trl_fp8.quantization` (tests check it) and write every operand in the
layout cuBLAS wants: row-major A, column-major B, column-major scales. `gemm` still checks strides, so operands from
elsewhere work too, copying only what is not already in place; for 128x128 B scales cuBLAS also wants the K-block
count padded to a multiple of 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trl_fp8 import kernels

_ST = F.ScalingType


def _on_tensor_device(fn):
    """Launch on the tensor's GPU: Triton kernels run on the current device, which a model spread over several
    GPUs (device_map="auto") does not keep in step with its layers."""

    def wrapper(x, *args, **kwargs):
        if x.device.index == torch.cuda.current_device():
            return fn(x, *args, **kwargs)
        with torch.cuda.device(x.device):
            return fn(x, *args, **kwargs)

    wrapper.__doc__ = fn.__doc__
    return wrapper


quantize_act = _on_tensor_device(kernels.quantize_act)
quantize_weight = _on_tensor_device(kernels.quantize_weight)
quantize_swiglu = _on_tensor_device(kernels.quantize_swiglu)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def _block_scale_k_major(s_kn: torch.Tensor) -> torch.Tensor:
    """[K/128, N/128] scales in the K-major layout cuBLAS wants, K blocks padded to a multiple of 4."""
    kb, nb = s_kn.shape
    padded = (kb + 3) // 4 * 4
    if padded == kb:
        return _col_major(s_kn)
    out = s_kn.new_ones(nb, padded).t()
    out[:kb].copy_(s_kn)
    return out


def gemm(a_q, a_s, b_q, b_s, b_blocks: bool, out_dtype: torch.dtype) -> torch.Tensor:
    mat_b = _col_major(b_q.t())
    if b_blocks:
        scale_b, recipe_b = _block_scale_k_major(b_s.t()), _ST.BlockWise128x128
    else:
        scale_b, recipe_b = _col_major(b_s), _ST.BlockWise1x128
    return F.scaled_mm(
        a_q if a_q.is_contiguous() else a_q.contiguous(),
        mat_b,
        scale_a=_col_major(a_s),
        scale_recipe_a=_ST.BlockWise1x128,
        scale_b=scale_b,
        scale_recipe_b=recipe_b,
        output_dtype=out_dtype,
    )
