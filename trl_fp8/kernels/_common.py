"""What the quantization kernels share: the scale arithmetic, step for step as
`trl_fp8.quantization._scale_from_amax` (448 is e4m3's largest finite value, 1e-12 the amax floor of all-zero
groups), the stores of a 128x128 tile in 1x128 groups, and the buffers of an activation's two layouts."""

import torch
import triton
import triton.language as tl

from trl_fp8.config import BLOCK
from trl_fp8.quantization import QuantizedAct


@triton.jit
def tile_offsets(BLOCK: tl.constexpr):
    """This program's tile of a `[M, K]` activation (grid: token blocks x feature blocks): the two program ids, the
    tile's token rows and feature columns, and the same in int64 for addresses past 2**31 elements."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK + tl.arange(0, BLOCK)
    rk = pid_k * BLOCK + tl.arange(0, BLOCK)
    return pid_m, pid_k, rm, rk, rm.to(tl.int64), rk.to(tl.int64)


@triton.jit
def fp8_scale(amax, POW2: tl.constexpr):
    """float32 multiplier 448 / amax (amax in float32, clamped at 1e-12, divided in float64), optionally rounded
    down to a power of two by clearing the mantissa bits (exact, unlike a log2 on the GPU)."""
    amax = tl.maximum(amax, 1e-12).to(tl.float64)
    scale = (448.0 / amax).to(tl.float32)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def scale_and_saturate(x, scale):
    """`x * scale` in float32, saturated at +-448; the caller's cast to e4m3 rounds to nearest even."""
    return tl.clamp(x * scale, -448.0, 448.0)


@triton.jit
def store_row_groups(x, q_ptr, s_ptr, rm64, rk64, pid_k, M_pad, K, POW2: tl.constexpr):
    """A float32 tile `x [BLOCK(tokens), BLOCK(features)]` in groups along features: `q [M_pad, K]` row-major and
    `scale_inv [M_pad, K/128]` column-major."""
    scale = fp8_scale(tl.max(tl.abs(x), axis=1), POW2)
    q = scale_and_saturate(x, scale[:, None]).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rm64[:, None] * K + rk64[None, :], q)
    tl.store(s_ptr + pid_k * M_pad + rm64, tl.div_rn(1.0, scale))


@triton.jit
def store_col_groups(x, qt_ptr, st_ptr, rm64, rk64, pid_m, M_pad, K, POW2: tl.constexpr):
    """The same tile in groups along tokens: `qt [K, M_pad]` row-major (a register transpose) and
    `scale_inv_t [K, M_pad/128]` column-major."""
    scale_t = fp8_scale(tl.max(tl.abs(x), axis=0), POW2)
    qt = scale_and_saturate(x, scale_t[None, :]).to(qt_ptr.dtype.element_ty)
    tl.store(qt_ptr + rk64[:, None] * M_pad + rm64[None, :], tl.trans(qt))
    tl.store(st_ptr + pid_m * K + rk64, tl.div_rn(1.0, scale_t))


def empty_act_layouts(m: int, k: int, rows: bool, cols: bool, device: torch.device) -> QuantizedAct:
    """Buffers for `x [m, k]` in the layouts asked for, tokens padded to `M_pad` (a multiple of 128), scales
    column-major as cuBLAS reads them."""
    m_pad = triton.cdiv(m, BLOCK) * BLOCK
    fp8 = torch.float8_e4m3fn
    q = s = qt = st = None
    if rows:
        q = torch.empty(m_pad, k, device=device, dtype=fp8)
        s = torch.empty(k // BLOCK, m_pad, device=device, dtype=torch.float32).t()
    if cols:
        qt = torch.empty(k, m_pad, device=device, dtype=fp8)
        st = torch.empty(m_pad // BLOCK, k, device=device, dtype=torch.float32).t()
    return QuantizedAct(q, s, qt, st)


def layout_pointers(act: QuantizedAct, rows: bool, cols: bool, traced: bool = False) -> tuple:
    """`(q, s, qt, st)` as a kernel's pointer arguments: a disabled layout's pointers are a live buffer of the other
    layout, which its constexpr flag keeps the kernel from touching. `traced` (a launch inside `torch.compile`, see
    `launcher`): empty buffers instead, since the compiler tracks what each argument's kernel writes and an argument
    must not alias another."""
    q, s, qt, st = act
    if traced:
        like = q if rows else qt
        q, qt = (t if t is not None else like.new_empty(0) for t in (q, qt))
        s, st = (t if t is not None else like.new_empty(0, dtype=torch.float32) for t in (s, st))
        return q, s, qt, st
    dummy = q if rows else qt
    return (q if rows else dummy, s if rows else st, qt if cols else dummy, st if cols else s)


def launcher(kernel, traced: bool):
    """`kernel`, launched as is (eager: the least host time) or through `torch.library.wrap_triton` (inside a
    `triton_op`, so that Inductor calls the kernel from its generated code)."""
    if not traced:
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)
