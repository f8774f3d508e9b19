"""Exact FP8 emulation: quantize with the reference quantizers, dequantize, multiply in fp32.

Runs on any device. Every rounding that the real kernels do happens here too (operands are e4m3 values times
float32 scales); only the fp32 summation order differs from cuBLAS. CPU tests run the whole precision flow on it.
"""

from __future__ import annotations

import torch

from trl_fp8.config import BLOCK
from trl_fp8.quantization import (
    dequantize_blocks,
    dequantize_groups,
    quantize_act_layouts,
    quantize_blocks,
    quantize_swiglu_layouts,
)


def quantize_act(x: torch.Tensor, *, rows: bool = True, cols: bool = False, power_of_two_scales: bool = False):
    return quantize_act_layouts(x, rows=rows, cols=cols, power_of_two_scales=power_of_two_scales)


def quantize_swiglu(gate, up, *, rows: bool = True, cols: bool = False, power_of_two_scales: bool = False):
    return quantize_swiglu_layouts(gate, up, rows=rows, cols=cols, power_of_two_scales=power_of_two_scales)


def quantize_weight(w: torch.Tensor, *, col_major: bool = False, power_of_two_scales: bool = False):
    return quantize_blocks(w, (BLOCK, BLOCK), power_of_two_scales=power_of_two_scales)  # layout is irrelevant here


def gemm(a_q, a_s, b_q, b_s, b_blocks: bool, out_dtype: torch.dtype) -> torch.Tensor:
    a = dequantize_groups(a_q, a_s)
    b = dequantize_blocks(b_q, b_s) if b_blocks else dequantize_groups(b_q, b_s)
    return (a @ b.t()).to(out_dtype)
