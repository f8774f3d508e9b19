"""vLLM's fused `rms_norm_per_block_quant` (RMSNorm, with or without the residual add, + 1x128 FP8 groups): the same
bits, reading the row from memory once.

In vLLM's block-FP8 engines every RMSNorm whose output feeds a block-FP8 linear is one CUDA op after the compile
pass `fuse_norm_quant`: `torch.ops._C.rms_norm_per_block_quant`. vLLM 0.31 launches it as one block of 512 threads
per token (256 beyond 256 tokens) that reads the row three times: once for the sum of squares, once for the groups'
largest magnitudes, once to normalize, quantize and write, each with a block-wide reduction and barriers between. Here
one program per row sweeps it twice: once for the sum of squares (the row's one read from memory), then, from the
cache, one iteration of vLLM's block at a time (each holds whole groups), to normalize, find each group's scale,
quantize and write the FP8 values, scales (and residual). On an H200, against a build of vLLM 0.31's kernel source,
inside CUDA graphs: 5.0 us against 7.1 at 256 x 4096 (a decode step of an 8B model), 31 against 74 at 4096 x 4096.

vLLM's arithmetic, step for step, in float32 (`csrc/libtorch_stable/quantization/fused_kernels/layernorm_utils.cuh`,
`vectorized::compute_rms`, `compute_dynamic_per_token_scales` and `norm_and_quant`, vLLM 0.31):

- `x = input + residual` in float32; the residual is overwritten with `x` rounded to the input dtype, and the norm
  goes on with the float32 `x` (not the rounded one);
- the sum of squares in vLLM's order, which decides its last bit: thread `t` of the block's `T` threads folds the
  4-element vectors `t, t + T, t + 2T...` of the row in, element by element, each a fused multiply-add (nvcc
  contracts `ss += x * x`); then cub's block reduction: a shuffle tree inside each warp of 32 (lane `l` adds lane
  `l + 1`, then `l + 2`, ... `l + 16`), and the warps' sums added one after the other, warp 0 first;
- `rms = rsqrtf(ss / hidden + eps)` (CUDA's approximate reciprocal square root, `eps` rounded to float32);
- `y = bf16(bf16(x * rms) * weight)` (the normalized value rounded to the input dtype before and after the weight);
- per group: `scale = max(min(amax, scale_ub) / 448, 1 / (448 * 512))` (`scale_ub` caps the amax, not the
  scale); `q = e4m3(clamp(y / scale, -448, 448))`, rounded to nearest even;
- scales at `row * groups + group`, or with `is_scale_transposed` at `group * rows' + row` where `rows'` is the
  token count rounded up to the scales' stride (TMA-aligned scales for DeepGEMM).

`T` is `min(hidden, 512)` for up to 256 tokens, else `min(hidden, 256)`; 512 always with vLLM's
`VLLM_BATCH_INVARIANT=1`. `NUMERICS` picks how the divisions are computed: "ieee" (correctly rounded, what nvcc emits
without fast math) or "fast" (approximate, what `--use_fast_math` emits). `trl_fp8.rollout.vllm.norm_quant` compares
both with vLLM's own kernel on the GPU at engine start and installs the one that gives the same bits, or none.

Floor: 2 bytes read and 1 written per element (plus 2 + 2 with the residual add, and 4 bytes of scale per group).
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from trl_fp8.kernels.vllm_silu_mul_quant import FP8_MAX, MIN_SCALE, NUMERICS, _div, _interpreted

__all__ = ["MAX_HIDDEN", "NUMERICS", "block_threads", "rms_norm_per_block_quant", "rms_norm_per_block_quant_reference"]

MAX_HIDDEN = 16384  # the widest row (its loops are unrolled: up to 16 vectors a thread)
WARP = 32


def block_threads(tokens: int, hidden: int) -> int:
    """The threads of vLLM's block for a call of `tokens` rows of `hidden` (`rms_norm_per_block_quant_dispatch`):
    `min(hidden, 512)` up to 256 tokens or under `VLLM_BATCH_INVARIANT=1`, else `min(hidden, 256)`."""
    number = re.match(r"\s*([+-]?\d+)", os.environ.get("VLLM_BATCH_INVARIANT", ""))  # (vLLM's `atoi(val) != 0`)
    batch_invariant = number is not None and int(number.group(1)) != 0
    return min(hidden, 512 if batch_invariant or tokens <= 256 else 256)


def _layout(tokens: int, hidden: int) -> tuple[int, int, int]:
    """`(threads, lanes, iterations)`: the threads of vLLM's block that hold a part of the row (`min(T, hidden / 4)`,
    the others add zeros), that count padded to a power of two of at least a warp, and the vectors each thread folds
    in."""
    threads = min(block_threads(tokens, hidden), hidden // 4)
    return threads, max(WARP, triton.next_power_of_2(threads)), triton.cdiv(hidden // 4, threads)


@triton.jit
def _add16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
           b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15):  # fmt: skip
    return (a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8, a9 + b9, a10 + b10,
            a11 + b11, a12 + b12, a13 + b13, a14 + b14, a15 + b15)  # fmt: skip


@triton.jit
def _at(w, k, i: tl.constexpr):
    """`w` where `k == i`, zeros elsewhere: summed, exactly `w[i]`."""
    return tl.where(k == i, w, 0.0)


@triton.jit
def _warp_sums_in_order(w, NWARPS: tl.constexpr):
    """`w[0] + w[1] + ... + w[NWARPS - 1]`, added one after the other (cub's block reduction over its warps' sums):
    every `w[i]` taken out in one reduction (each a sum of one value and zeros, so exact), then added in order."""
    k = tl.arange(0, NWARPS)
    r = tl.reduce(
        (_at(w, k, 0), _at(w, k, 1), _at(w, k, 2), _at(w, k, 3), _at(w, k, 4), _at(w, k, 5), _at(w, k, 6),
         _at(w, k, 7), _at(w, k, 8), _at(w, k, 9), _at(w, k, 10), _at(w, k, 11), _at(w, k, 12), _at(w, k, 13),
         _at(w, k, 14), _at(w, k, 15)),
        0, _add16,
    )  # fmt: skip
    total = r[0]
    for i in tl.static_range(1, NWARPS):
        total += r[i]
    return total


@triton.jit
def _row_tile(x_row, r_row, i, lane, j4, THREADS: tl.constexpr, H: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Iteration `i` of vLLM's block over the row: thread `t`'s 4-element vector `i * THREADS + t`, as float32 (the
    residual added), its columns and mask."""
    col = (i * THREADS + lane)[:, None] * 4 + j4[None, :]
    mask = (lane < THREADS)[:, None] & (col < H)
    x = tl.load(x_row + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_row + col, mask=mask, other=0.0).to(tl.float32)
    return x, col, mask


@triton.jit(do_not_specialize=["x_stride", "scale_rows"])
def _rms_norm_quant_kernel(
    x_ptr, w_ptr, r_ptr, q_ptr, s_ptr, ub_ptr,
    x_stride, scale_rows, eps,
    H: tl.constexpr, HF: tl.constexpr, GROUP: tl.constexpr, THREADS: tl.constexpr, LANES: tl.constexpr,
    ITERS: tl.constexpr, CONTIGUOUS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_UB: tl.constexpr,
    SCALES_T: tl.constexpr, IEEE: tl.constexpr, LIBDEVICE: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if CONTIGUOUS:
        x_row = x_ptr + row * H
    else:
        x_row = x_ptr + row * x_stride
    r_row = r_ptr + row * H
    lane = tl.arange(0, LANES)  # vLLM's threads (padded to a power of two)
    j4 = tl.arange(0, 4)

    # The sum of squares in vLLM's order: each thread's fused multiply-adds, vector by vector, element by element,
    acc = tl.zeros([LANES], dtype=tl.float32)
    for i in tl.static_range(ITERS):
        x, col, mask = _row_tile(x_row, r_row, i, lane, j4, THREADS, H, HAS_RESIDUAL)
        lo, hi = tl.split(tl.reshape(x, [LANES, 2, 2]))  # (element j = 2 * j1 + j0): j0 = 0 and j0 = 1
        x0, x2 = tl.split(lo)
        x1, x3 = tl.split(hi)
        acc = tl.fma(x0, x0, acc)
        acc = tl.fma(x1, x1, acc)
        acc = tl.fma(x2, x2, acc)
        acc = tl.fma(x3, x3, acc)
    # then cub's warp reduction (shuffle-down by 1, 2, 4, 8, 16: neighbours, then pairs of pairs: each a sum over an
    # axis of two), then the warps' sums one after the other
    NWARPS: tl.constexpr = LANES // 32
    t = tl.reshape(acc, [NWARPS, 2, 2, 2, 2, 2])
    t = tl.sum(t, axis=5)
    t = tl.sum(t, axis=4)
    t = tl.sum(t, axis=3)
    t = tl.sum(t, axis=2)
    ss = _warp_sums_in_order(tl.sum(t, axis=1), NWARPS)
    mean = _div(ss, HF, IEEE) + eps
    if LIBDEVICE:
        rms = libdevice.rsqrt(mean)  # __nv_rsqrtf, what CUDA's rsqrtf compiles to
    else:
        rms = tl.math.rsqrt(mean)  # 1 / sqrt in NumPy's float32 in the interpreter (as the reference)

    # The row again (from the cache), iteration by iteration: each holds whole groups. (Every thread's reads of the
    # residual above come before any thread overwrites it below.)
    tl.debug_barrier()
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    NG: tl.constexpr = LANES * 4 // GROUP  # groups of one iteration (padded)
    GROUPS_PER_ITER: tl.constexpr = THREADS * 4 // GROUP
    g = tl.arange(0, NG)
    for i in tl.static_range(ITERS):
        x, col, mask = _row_tile(x_row, r_row, i, lane, j4, THREADS, H, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(r_row + col, x.to(dtype), mask=mask)
        w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
        y = ((x * rms).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        y3 = tl.reshape(y, [NG, GROUP // 4, 4])
        scale = tl.max(tl.max(tl.abs(y3), axis=2), axis=1)
        if HAS_UB:
            scale = tl.minimum(scale, tl.load(ub_ptr))
        scale = tl.maximum(_div(scale, FP8_MAX, IEEE), MIN_SCALE)
        q = tl.clamp(_div(y3, scale[:, None, None], IEEE), -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * H + col, tl.reshape(q, [LANES, 4]), mask=mask)
        group = i * GROUPS_PER_ITER + g
        g_mask = (g < GROUPS_PER_ITER) & (group < H // GROUP)
        if SCALES_T:  # vLLM's flag, not the tensor's strides, says where a scale goes (its kernel does the same)
            s_off = group * scale_rows + row
        else:
            s_off = row * (H // GROUP) + group
        tl.store(s_ptr + s_off, scale, mask=g_mask)


def _check(out, x, weight, scales, residual, group_size):
    hidden = x.shape[-1]
    if out.shape != x.shape or weight.shape != (hidden,):
        raise ValueError(f"rms_norm_per_block_quant: out, input [..., H] and weight [H]; got {tuple(out.shape)}, "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}.")  # fmt: skip
    if out.dtype != torch.float8_e4m3fn or x.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(
            f"trl-fp8's rms_norm_per_block_quant takes BF16/FP16 input and float8_e4m3fn output (the FP8 engine's "
            f"case); got {x.dtype} -> {out.dtype}. Keep vLLM's kernel for other quantization types "
            "(FP8Tuning(vllm_norm_quant_kernel='vllm'))."
        )
    if weight.dtype != x.dtype or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape)):
        raise ValueError("rms_norm_per_block_quant: weight and residual must have the input's dtype (and shape).")
    if group_size not in (64, 128) or hidden % group_size:
        raise ValueError(f"group_size must be 64 or 128 and divide {hidden}; got {group_size}.")
    if hidden > MAX_HIDDEN:
        raise NotImplementedError(
            f"trl-fp8's rms_norm_per_block_quant takes rows of up to {MAX_HIDDEN}; got {hidden}."
        )
    if x.stride(-1) != 1 or not out.is_contiguous() or not weight.is_contiguous() or scales.dtype != torch.float32:
        raise ValueError("rms_norm_per_block_quant needs input contiguous in its last dimension, contiguous out and "
                         "weight, and float32 scales.")  # fmt: skip
    if residual is not None and not residual.is_contiguous():
        raise ValueError("rms_norm_per_block_quant needs a contiguous residual.")


def rms_norm_per_block_quant(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    epsilon: float,
    scale_ub: torch.Tensor | None,
    residual: torch.Tensor | None,
    group_size: int,
    is_scale_transposed: bool,
    *,
    numerics: str = "ieee",
) -> None:
    """vLLM's op, in place (its schema's arguments, in its order): `x [..., H]` (plus `residual`, which then holds
    the sum) -> `out` float8_e4m3fn and `scales`: `[M, H/group]` per token (row-major storage) or, with
    `is_scale_transposed`, `[H/group, M']` storage with `M'` the scales' stride (vLLM hands in its transposed view)."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics={numerics!r}; use one of {NUMERICS}.")
    _check(out, x, weight, scales, residual, group_size)
    hidden = x.shape[-1]
    x2 = x.view(-1, hidden)  # (vLLM views it so too, and takes its row stride)
    tokens = x2.shape[0]
    outer = scales.stride(1) if scales.dim() > 1 else 1  # (vLLM's `outer_scale_stride`, whatever the scales' rank)
    if outer > 1 and not is_scale_transposed:
        raise ValueError("rms_norm_per_block_quant: outer scale stride must be 1 when scales are not transposed.")
    if tokens == 0:
        return
    scale_rows = triton.cdiv(tokens, outer) * outer  # vLLM's `scale_rows` for transposed scales
    threads, lanes, iters = _layout(tokens, hidden)
    if x2.stride(0) % 4:
        raise ValueError("rms_norm_per_block_quant: the input's row stride must be a multiple of 4.")
    _rms_norm_quant_kernel[(tokens,)](
        x2, weight, residual if residual is not None else x2, out, scales,
        scale_ub if scale_ub is not None else scales,
        x2.stride(0), scale_rows, float(epsilon),
        H=hidden, HF=float(hidden), GROUP=group_size, THREADS=threads, LANES=lanes, ITERS=iters,
        CONTIGUOUS=x2.stride(0) == hidden, HAS_RESIDUAL=residual is not None, HAS_UB=scale_ub is not None,
        SCALES_T=bool(is_scale_transposed), IEEE=numerics == "ieee", LIBDEVICE=not _interpreted(), FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE,
        num_warps=max(4, min(16, lanes // WARP)),  # (a thread of vLLM's block each, up to 16 warps)
    )  # fmt: skip


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 `a * b + c` rounded once (as the GPU's `fma.rn.f32`): the exact product in float64, the sum rounded to
    odd in float64 (its exact error from TwoSum), then to float32, which is the correctly rounded result."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    odd = (s.view(np.int64) & 1) == 1
    toward = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
    return np.where((err != 0) & ~odd, toward, s).astype(np.float32)


def _sum_of_squares(x: np.ndarray, threads: int) -> np.ndarray:
    """`[M, H]` float32 -> `[M]`: the sum of squares in the order of vLLM's block of `threads` threads."""
    m, hidden = x.shape
    vectors = hidden // 4
    iters = -(-vectors // threads)
    v = np.zeros((m, iters * threads, 4), dtype=np.float32)
    v[:, :vectors] = x.reshape(m, vectors, 4)
    v = v.reshape(m, iters, threads, 4)
    acc = np.zeros((m, threads), dtype=np.float32)
    for i in range(iters):
        for j in range(4):
            acc = _fma32(v[:, i, :, j], v[:, i, :, j], acc)
    lanes = -(-threads // WARP) * WARP
    acc = np.concatenate([acc, np.zeros((m, lanes - threads), dtype=np.float32)], axis=1).reshape(m, -1, WARP)
    while acc.shape[-1] > 1:  # the warp's shuffle tree: neighbours, then pairs of pairs
        acc = acc[..., 0::2] + acc[..., 1::2]
    warps = acc[..., 0]
    ss = warps[:, 0].copy()
    for k in range(1, warps.shape[1]):
        ss = ss + warps[:, k]
    return ss


def rms_norm_per_block_quant_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_size: int,
    scale_ub: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The same arithmetic on the CPU, in NumPy's and torch's float32 (each step correctly rounded, `rsqrtf` as
    `1 / sqrt` in float32, as in Triton's interpreter): `(q [M, H], scales [M, H/group], residual_out [M, H] or
    None)` for `x [M, H]`; `threads` is vLLM's block (default: `block_threads`)."""
    dtype = x.dtype
    m, hidden = x.shape
    xf = x.detach().cpu().float().numpy()
    residual_out = None
    if residual is not None:
        xf = xf + residual.detach().cpu().float().numpy()
        residual_out = torch.from_numpy(xf).to(dtype)
    threads = min(block_threads(m, hidden) if threads is None else threads, hidden // 4)
    ss = _sum_of_squares(xf, threads)
    mean = ss / np.float32(hidden) + np.float32(epsilon)
    rms = 1 / np.sqrt(mean)  # (the interpreter's rsqrt)
    normed = torch.from_numpy(xf * rms[:, None]).to(dtype).float()
    y = (normed * weight.detach().cpu().float()).to(dtype).float()
    groups = y.view(m, hidden // group_size, group_size)
    scale = groups.abs().amax(dim=-1)
    if scale_ub is not None:
        scale = torch.minimum(scale, scale_ub.detach().cpu().float().reshape(()))
    scale = (scale / FP8_MAX).clamp(min=MIN_SCALE)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, hidden), scale, residual_out
