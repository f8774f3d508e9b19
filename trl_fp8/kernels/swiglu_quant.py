"""SiLU(gate) * up, quantized in 1x128 groups in both GEMM layouts, from one read of gate and up.

The gated MLP's activation `h = silu(gate) * up [M, I]` is read only by `down_proj`, which multiplies its FP8
quantization. In eager PyTorch that is three passes (silu, mul, quantize) and a BF16 `h` written and read back; here
one program per 128x128 tile loads gate and up, forms `h` with eager's roundings (silu rounded to the input dtype,
times up, rounded again), and writes only what the GEMMs read: `q [M_pad, I]` with `scale_inv [M_pad, I/128]`
(groups along I, down_proj's FProp operand) and `qt [I, M_pad]` with `scale_inv_t [I, M_pad/128]` (groups along
tokens, its WGrad operand); scales column-major as cuBLAS reads them. Padded tokens are zeros, as in
`act_quant.py`. The reference is `trl_fp8.quantization.quantize_act_layouts(F.silu(gate) * up)`.

Floor: 2 bytes read per element for each of gate and up, 1 + 1 written (both FP8 layouts): 6 B/element, against
14 B/element for eager's silu, mul and quantization passes (`benchmarks/bench_quant.py` measures it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trl_fp8.kernels._common import (
    BLOCK,
    empty_act_layouts,
    launcher,
    layout_pointers,
    store_col_groups,
    store_row_groups,
    tile_offsets,
)
from trl_fp8.quantization import QuantizedAct


@triton.jit
def _swiglu_quant_kernel(
    g_ptr, stride_gm, u_ptr, stride_um,
    q_ptr, s_ptr, qt_ptr, st_ptr, h_ptr,
    M, M_pad, K,
    ROWS: tl.constexpr, COLS: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, STORE_H: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k, rm, rk, rm64, rk64 = tile_offsets(BLOCK)
    mask = rm[:, None] < M
    g = tl.load(g_ptr + rm64[:, None] * stride_gm + rk64[None, :], mask=mask, other=0.0)
    u = tl.load(u_ptr + rm64[:, None] * stride_um + rk64[None, :], mask=mask, other=0.0)
    g32 = g.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # eager rounds silu's output to the input dtype...
    h = (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)  # ...and the product again
    if STORE_H:
        tl.store(h_ptr + rm64[:, None] * K + rk64[None, :], h, mask=mask)
    h = h.to(tl.float32)
    if ROWS:
        store_row_groups(h, q_ptr, s_ptr, rm64, rk64, pid_k, M_pad, K, POW2)
    if COLS:
        store_col_groups(h, qt_ptr, st_ptr, rm64, rk64, pid_m, M_pad, K, POW2)


def quantize_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    rows: bool = True,
    cols: bool = False,
    power_of_two_scales: bool = False,
    out: torch.Tensor | None = None,
    traced: bool = False,
) -> QuantizedAct:
    """`silu(gate) * up` for 2-D `gate, up [M, I]` (unit stride along I, I a multiple of 128; column slices of one
    gate_up output are fine), quantized into the layouts asked for. The product itself is written only into `out`
    (contiguous `[M, I]`, the inputs' dtype) when one is given. `traced`: launched for `torch.compile`."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(
            f"quantize_swiglu needs gate and up of one shape and dtype with unit stride along the last dim; got "
            f"{tuple(gate.shape)} {gate.dtype} stride {gate.stride()} and {tuple(up.shape)} {up.dtype} stride "
            f"{up.stride()}."
        )
    m, k = gate.shape
    if out is not None and (out.shape != gate.shape or out.dtype != gate.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(gate.shape)} {gate.dtype} tensor.")
    result = empty_act_layouts(m, k, rows, cols, gate.device)
    m_pad = triton.cdiv(m, BLOCK) * BLOCK
    if m_pad:
        pointers = layout_pointers(result, rows, cols, traced)
        launcher(_swiglu_quant_kernel, traced)[(m_pad // BLOCK, k // BLOCK)](
            gate, gate.stride(0), up, up.stride(0),
            *pointers,
            out if out is not None else (pointers[0].new_empty(0) if traced else pointers[0]),  # (unwritten without STORE_H)
            m, m_pad, k,
            ROWS=rows, COLS=cols, POW2=power_of_two_scales, BLOCK=BLOCK, STORE_H=out is not None,
            num_warps=4 if cols else 8, num_stages=1,
        )  # fmt: skip
    return result
