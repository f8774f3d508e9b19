"""1x128 group quantization of activations and output gradients, both operand layouts from one read.

For `x [M, K]` (tokens x features) the blockwise GEMMs need:
- rows: `q [M_pad, K]` row-major with `scale_inv [M_pad, K/128]` (groups along K), the A operand of FProp/DGrad;
- cols: `qt [K, M_pad]` row-major with `scale_inv [K, M_pad/128]` (groups along tokens), an operand of WGrad.
Scales are written column-major, the layout cuBLAS's blockwise `scaled_mm` reads, so nothing is copied later.
`M_pad` rounds the token count up to 128; padded tokens are zeros (they change no group's amax), so WGrad needs no
separate padding copy. One program owns one 128x128 tile and computes its row and column amaxes from one load.

Launch: 4 warps when writing both layouts (the column layout's transposed store is the slow half), 8 for the row
layout alone, as `benchmarks/bench_quant.py` found best (docs/contributing/engineering-notes.md). `cols_second_read`
is a candidate: the
column layout from a second, K-major read of the tile (an L1/L2 hit, not HBM), stored without a register transpose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trl_fp8.kernels._common import (
    BLOCK,
    empty_act_layouts,
    fp8_scale,
    launcher,
    layout_pointers,
    scale_and_saturate,
    store_col_groups,
    store_row_groups,
    tile_offsets,
)
from trl_fp8.quantization import QuantizedAct


@triton.jit
def _act_quant_kernel(
    x_ptr, stride_xm, stride_xk, src_ptr,
    q_ptr, s_ptr, qt_ptr, st_ptr,
    M, M_pad, K,
    ROWS: tl.constexpr, COLS: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, COLS_SECOND_READ: tl.constexpr,
    GATHER: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k, rm, rk, rm64, rk64 = tile_offsets(BLOCK)
    if GATHER:  # output row r is x's row src[r], or zeros where src[r] < 0
        src = tl.load(src_ptr + rm, mask=rm < M, other=-1)
        x = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xm + rk64[None, :] * stride_xk,
                    mask=src[:, None] >= 0, other=0.0).to(tl.float32)  # fmt: skip
    elif ROWS or not COLS_SECOND_READ:
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + rk64[None, :] * stride_xk, mask=rm[:, None] < M, other=0.0)
        x = x.to(tl.float32)
    if ROWS:
        store_row_groups(x, q_ptr, s_ptr, rm64, rk64, pid_k, M_pad, K, POW2)
    if COLS:
        if COLS_SECOND_READ:  # the tile read again as [K, M]: groups along tokens are then rows
            xt = tl.load(
                x_ptr + rk64[:, None] * stride_xk + rm64[None, :] * stride_xm, mask=rm[None, :] < M, other=0.0
            )
            xt = xt.to(tl.float32)
            scale_t = fp8_scale(tl.max(tl.abs(xt), axis=1), POW2)
            qt = scale_and_saturate(xt, scale_t[:, None]).to(qt_ptr.dtype.element_ty)
            tl.store(qt_ptr + rk64[:, None] * M_pad + rm64[None, :], qt)
            tl.store(st_ptr + pid_m * K + rk64, tl.div_rn(1.0, scale_t))  # column-major [K, M_pad/128]
        else:
            store_col_groups(x, qt_ptr, st_ptr, rm64, rk64, pid_m, M_pad, K, POW2)


def quantize_act(
    x: torch.Tensor,
    *,
    rows: bool = True,
    cols: bool = False,
    power_of_two_scales: bool = False,
    num_warps: int | None = None,
    cols_second_read: bool = False,
    traced: bool = False,
    source_rows: torch.Tensor | None = None,
) -> QuantizedAct:
    """Quantize a 2-D `x [M, K]` (any strides, K a multiple of 128) into the layouts asked for; bit for bit
    `trl_fp8.quantization.quantize_act_layouts`, with the scales column-major. `num_warps` (default: the measured
    best, 4 with the column layout, else 8) and `cols_second_read` change only how the kernel runs
    (`benchmarks/bench_quant.py` sweeps both), never the result; `traced`: launched for `torch.compile`
    (`trl_fp8.ops.triton_ops`).

    `source_rows` (int32 `[M']`): quantize the rows `x[source_rows]` instead, a negative entry standing for a row of
    zeros; the same result as quantizing that gathered tensor, without writing it (the mixture-of-experts layout,
    `grouped_gemm.GroupedRows.source`)."""
    if num_warps is None:
        num_warps = 4 if cols else 8
    gather = source_rows is not None
    if gather and cols_second_read:
        raise ValueError("quantize_act: source_rows and cols_second_read do not go together")
    m, k = (source_rows.shape[0], x.shape[1]) if gather else x.shape
    out = empty_act_layouts(m, k, rows, cols, x.device)
    m_pad = triton.cdiv(m, BLOCK) * BLOCK
    if m_pad:
        launcher(_act_quant_kernel, traced)[(m_pad // BLOCK, k // BLOCK)](
            x, x.stride(0), x.stride(1), source_rows if gather else x,
            *layout_pointers(out, rows, cols, traced),
            m, m_pad, k,
            ROWS=rows, COLS=cols, POW2=power_of_two_scales, BLOCK=BLOCK, COLS_SECOND_READ=cols_second_read,
            GATHER=gather,
            num_warps=num_warps, num_stages=1,
        )  # fmt: skip
    return out
