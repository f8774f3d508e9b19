"""Real FP8 kernels on Hopper: torchao's blockwise Triton quantizers and cuBLAS blockwise `F.scaled_mm`.

torchao's kernels compute the same bits as `trl_fp8.quantization` (tests/gpu checks it); with power-of-two scales,
which they do not offer, the reference quantizers run on the GPU instead. cuBLAS wants row-major A, column-major B,
column-major scales and, for 128x128 B scales, a K-block count padded to a multiple of 4; `gemm` arranges that
from logical tensors, copying only what is not already in place.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torchao.prototype.blockwise_fp8_training.kernels import (
    triton_fp8_blockwise_act_quant_lhs,
    triton_fp8_blockwise_act_quant_transposed_lhs,
    triton_fp8_blockwise_weight_quant_rhs,
    triton_fp8_blockwise_weight_quant_transposed_rhs,
)

from . import emulated

_ST = F.ScalingType


def _on_tensor_device(fn):
    """Launch on the tensor's GPU: Triton kernels run on the current device, which a model spread over several
    GPUs (device_map="auto") does not keep in step with its layers."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        with torch.cuda.device(x.device):
            return fn(x, *args, **kwargs)

    return wrapper


@_on_tensor_device
def quantize_act(x: torch.Tensor, *, power_of_two_scales: bool = False):
    if power_of_two_scales:
        return emulated.quantize_act(x, power_of_two_scales=True)
    return triton_fp8_blockwise_act_quant_lhs(x.contiguous(), 128)


@_on_tensor_device
def quantize_act_t(x: torch.Tensor, *, power_of_two_scales: bool = False):
    if power_of_two_scales:
        return emulated.quantize_act_t(x, power_of_two_scales=True)
    return triton_fp8_blockwise_act_quant_transposed_lhs(x.contiguous(), 128)


@_on_tensor_device
def quantize_weight(w: torch.Tensor, *, power_of_two_scales: bool = False):
    if power_of_two_scales:
        return emulated.quantize_weight(w, power_of_two_scales=True)
    # The kernel returns w.T quantized in column-major storage, i.e. q row-major [N, K] once transposed back.
    q_t, s_t = triton_fp8_blockwise_weight_quant_transposed_rhs(w.contiguous(), block_size=128)
    return q_t.t(), s_t.t()


@_on_tensor_device
def quantize_weight_dgrad(w: torch.Tensor, *, power_of_two_scales: bool = False):
    if power_of_two_scales:
        return emulated.quantize_weight(w, power_of_two_scales=True)
    # Column-major q [N, K]: exactly the B operand layout of dy @ W, so `gemm` copies nothing.
    return triton_fp8_blockwise_weight_quant_rhs(w.contiguous(), block_size=128)


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
        a_q.contiguous(),
        mat_b,
        scale_a=_col_major(a_s),
        scale_recipe_a=_ST.BlockWise1x128,
        scale_b=scale_b,
        scale_recipe_b=recipe_b,
        output_dtype=out_dtype,
    )
