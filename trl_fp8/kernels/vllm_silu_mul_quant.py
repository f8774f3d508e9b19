"""vLLM's fused `silu_and_mul_per_block_quant`: the same bits, faster.

In vLLM's block-FP8 engines the gated MLP's `silu(gate) * up` and its 1x128-group FP8 quantization (`down_proj`'s
input) are one CUDA op, `torch.ops._C.silu_and_mul_per_block_quant`. vLLM 0.26 launches it as one 128-thread block
per (token, group), each reducing its group's amax through shared memory: far below the speed its bytes allow. Here
one program quantizes a tile of `BLOCK_M` tokens x one group: nearer that floor, bound by the float32 arithmetic (a
correctly rounded division per element, as vLLM's) more than by its bytes. The times of both against the floor:
`benchmarks/bench_quant.py`, docs/contributing/engineering-notes.md, "The activation quantization kernel, in detail".

The arithmetic is vLLM's, step for step, in float32: `s = gate * (1 / (1 + exp(-gate)))`, `r = s * up`;
`scale = max(|r|) / 448`, capped by `scale_ub` when given, floored at `1 / (448 * 512)`; `q = e4m3(clamp(r / scale,
-448, 448))`, rounded to nearest even. `NUMERICS` picks how `exp` and the divisions are computed: "ieee"
(CUDA's `expf` and correctly rounded division, what nvcc emits without fast math) or "fast" (`ex2.approx` and
approximate division, what `--use_fast_math` emits). `trl_fp8.rollout.vllm.act_quant` compares both with vLLM's own
kernel on the GPU at engine start and installs the one that gives the same bits, or none.

Floor: 2 + 2 bytes read and 1 written per output element (plus 4 bytes of scale per 128).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["NUMERICS", "silu_and_mul_per_block_quant", "silu_and_mul_per_block_quant_reference"]

NUMERICS = ("ieee", "fast")
FP8_MAX = 448.0
# vLLM's `min_scaling_factor<Float8_e4m3fn>`: 1.0f / (448 * 512.0f), a float32 division
MIN_SCALE = float(np.float32(1.0) / np.float32(FP8_MAX * 512.0))
BLOCK_M = 16  # tokens per program: one compiled kernel for every token count


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)  # __nv_expf, what CUDA's expf compiles to
    return tl.exp(x)  # on the GPU ex2.approx of x * log2(e), what __expf compiles to; NumPy's exp in the interpreter


@triton.jit
def _div(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.div_rn(a, b)
    return a / b


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, ub_ptr,
    M, N,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HAS_UB: tl.constexpr, SCALES_T: tl.constexpr, IEEE: tl.constexpr,
    LIBDEVICE: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = group * GROUP + tl.arange(0, GROUP)
    rm64 = rm.to(tl.int64)
    row_ok = rm < M
    mask = row_ok[:, None]
    gate_ptrs = x_ptr + rm64[:, None] * (2 * N) + rk[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    sigmoid = _div(1.0, 1.0 + _exp(-gate, LIBDEVICE), IEEE)
    r = (gate * sigmoid) * up
    scale = _div(tl.max(tl.abs(r), axis=1), FP8_MAX, IEEE)
    if HAS_UB:
        scale = tl.minimum(scale, tl.load(ub_ptr))
    scale = tl.maximum(scale, MIN_SCALE)
    q = tl.clamp(_div(r, scale[:, None], IEEE), -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rm64[:, None] * N + rk[None, :], q, mask=mask)
    if SCALES_T:  # vLLM's flag, not the tensor's strides, says where a scale goes (its kernel does the same)
        s_off = group * M + rm64
    else:
        s_off = rm64 * (N // GROUP) + group
    tl.store(s_ptr + s_off, scale, mask=row_ok)


def _interpreted() -> bool:
    # Triton's CPU interpreter has no libdevice: there `exp` is NumPy's float32 exp, which the reference uses too
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check(out, x, scales, group_size):
    if x.ndim != 2 or out.ndim != 2 or x.shape[1] != 2 * out.shape[1] or x.shape[0] != out.shape[0]:
        raise ValueError(f"silu_and_mul_per_block_quant: input [M, 2N] and out [M, N]; got {tuple(x.shape)} and "
                         f"{tuple(out.shape)}.")  # fmt: skip
    if out.dtype != torch.float8_e4m3fn or x.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(
            f"trl-fp8's silu_and_mul_per_block_quant takes BF16/FP16 input and float8_e4m3fn output (the FP8 engine's "
            f"case); got {x.dtype} -> {out.dtype}. Keep vLLM's kernel for other quantization "
            "types (FP8Tuning(vllm_act_quant_kernel='vllm'))."
        )
    if group_size not in (64, 128) or out.shape[1] % group_size:
        raise ValueError(f"group_size must be 64 or 128 and divide {out.shape[1]}; got {group_size}.")
    if not (x.is_contiguous() and out.is_contiguous()) or scales.dtype != torch.float32:
        raise ValueError("silu_and_mul_per_block_quant needs contiguous input and out, and float32 scales.")


def silu_and_mul_per_block_quant(
    out: torch.Tensor,
    x: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    scale_ub: torch.Tensor | None = None,
    is_scale_transposed: bool = False,
    *,
    numerics: str = "ieee",
) -> None:
    """vLLM's op, in place: `x [M, 2N]` (gate then up) -> `out [M, N]` float8_e4m3fn and `scales`, `[M, N/group]`
    per token (row-major storage) or, with `is_scale_transposed`, `[N/group, M]` storage (vLLM hands in its
    transposed view)."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics={numerics!r}; use one of {NUMERICS}.")
    _check(out, x, scales, group_size)
    m, n = out.shape
    if m == 0:
        return
    _silu_mul_quant_kernel[(triton.cdiv(m, BLOCK_M), n // group_size)](
        x, out, scales, scale_ub if scale_ub is not None else scales,
        m, n,
        GROUP=group_size, BLOCK_M=BLOCK_M, HAS_UB=scale_ub is not None, SCALES_T=bool(is_scale_transposed),
        IEEE=numerics == "ieee", LIBDEVICE=numerics == "ieee" and not _interpreted(), FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE,
        num_warps=4,
    )  # fmt: skip


def silu_and_mul_per_block_quant_reference(
    x: torch.Tensor, group_size: int, scale_ub: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same arithmetic in float32 on the CPU, `exp` NumPy's (as in Triton's interpreter), every other step
    correctly rounded: `(q [M, N], scales [M, N/group])`."""
    g, u = x.detach().cpu().float().chunk(2, dim=-1)
    e = torch.from_numpy(np.exp(-g.numpy()))
    r = (g * (1.0 / (1.0 + e))) * u
    m, n = r.shape
    groups = r.view(m, n // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / FP8_MAX
    if scale_ub is not None:
        scale = torch.minimum(scale, scale_ub.float().reshape(()))
    scale = scale.clamp(min=MIN_SCALE)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, n), scale
