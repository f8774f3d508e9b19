"""128x128 block quantization of a weight `w [N, K]`, written row-major or column-major.

Row-major `q [N, K]` is FProp's operand and what the vLLM sync and the exporter send; column-major (storage `[K, N]`)
is the operand of DGrad's `dy @ W`, which Hopper's FP8 tensor cores read K-major. Re-quantizing the weight for DGrad
costs one read of the weight and keeps no second FP8 copy alive between forward and backward. Where the row-major
blocks are kept anyway (the layer's weight cache), `transpose_expert_weights` moves them into DGrad's layout instead:
the same bytes, reading one byte per weight where re-quantizing reads two. Scales are
`[N/128, K/128]` float32, row-major for the row layout and column-major for the other (cuBLAS's layouts).
Edge blocks may be partial (zero padding changes no amax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trl_fp8.kernels._common import BLOCK, fp8_scale, launcher, scale_and_saturate


@triton.jit
def _weight_quant_kernel(
    w_ptr, stride_wn, stride_wk, q_ptr, s_ptr, N, K, NB, KB, GROUP_N, LD,
    COL_MAJOR: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rk = (pid_k * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
    scale = fp8_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), POW2)
    q = scale_and_saturate(w, scale).to(q_ptr.dtype.element_ty)
    if COL_MAJOR:  # each group of GROUP_N rows (an expert; all rows for one weight) stored as its own [K, LD]
        g = (pid_n * BLOCK) // GROUP_N
        nbg = GROUP_N // BLOCK
        rn_g = rn - g * GROUP_N
        q_g = q_ptr + g.to(tl.int64) * GROUP_N * K
        tl.store(q_g + rk[:, None] * LD + rn_g[None, :], tl.trans(q), mask=tl.trans(mask))
        tl.store(s_ptr + g * KB * nbg + pid_k * nbg + (pid_n - g * nbg), tl.div_rn(1.0, scale))
    else:
        tl.store(q_ptr + rn[:, None] * K + rk[None, :], q, mask=mask)
        tl.store(s_ptr + pid_n * KB + pid_k, tl.div_rn(1.0, scale))


def empty_weight_layout(n: int, k: int, col_major: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for the FP8 blocks of `w [n, k]` and their scales, stored row-major or column-major."""
    nb, kb = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    if col_major:
        q = torch.empty(k, n, device=device, dtype=torch.float8_e4m3fn).t()
        return q, torch.empty(kb, nb, device=device, dtype=torch.float32).t()
    return torch.empty(n, k, device=device, dtype=torch.float8_e4m3fn), torch.empty(nb, kb, device=device)


def quantize_weight(
    w: torch.Tensor,
    *,
    col_major: bool = False,
    power_of_two_scales: bool = False,
    num_warps: int = 8,
    traced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [N, K], scale_inv [N/128, K/128])`; `col_major` picks the storage order of both. `num_warps` changes
    only the launch, never the result; `traced`: launched for `torch.compile`."""
    n, k = w.shape
    nb, kb = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    q, s = empty_weight_layout(n, k, col_major, w.device)
    if n and k:
        launcher(_weight_quant_kernel, traced)[(nb, kb)](
            w, w.stride(0), w.stride(1), q, s, n, k, nb, kb, nb * BLOCK, n,
            COL_MAJOR=col_major, POW2=power_of_two_scales, BLOCK=BLOCK, num_warps=num_warps, num_stages=1,
        )  # fmt: skip
    return q, s


def quantize_expert_weights_t(
    w: torch.Tensor, *, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' weights `w [E, N, K]` (N and K multiples of 128) in 128x128 blocks, each expert's stored
    transposed: `(q [E, K, N], scale_inv [E, K/128, N/128])`, both contiguous. The same FP8 values and scales as
    `quantize_weight(w.reshape(E * N, K))`, transposed per expert: the operand of a grouped DGrad `dy_e @ W_e`,
    K-major for the tensor cores (DeepGEMM's grouped kernel wants each expert's matrix contiguous)."""
    e, n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"quantize_expert_weights_t: N={n} and K={k} must be multiples of {BLOCK}")
    q = torch.empty(e, k, n, device=w.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(e, k // BLOCK, n // BLOCK, device=w.device, dtype=torch.float32)
    if q.numel():
        w2 = w.reshape(e * n, k)
        _weight_quant_kernel[(e * n // BLOCK, k // BLOCK)](
            w2, w2.stride(0), w2.stride(1), q, s, e * n, k, e * n // BLOCK, k // BLOCK, n, n,
            COL_MAJOR=True, POW2=power_of_two_scales, BLOCK=BLOCK, num_warps=8, num_stages=1,
        )  # fmt: skip
    return q, s


@triton.jit
def _transpose_blocks_kernel(q_ptr, qt_ptr, N, K, BLOCK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    base = tl.program_id(2).to(tl.int64) * N * K  # the expert's matrix
    rn = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rk = (pid_k * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    tile = tl.load(q_ptr + base + rn[:, None] * K + rk[None, :])
    tl.store(qt_ptr + base + rk[:, None] * N + rn[None, :], tl.trans(tile))


def transpose_expert_weights(q: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_expert_weights_t`'s result from the row-major blocks `q [E, N, K]`, `scale_inv [E, N/128, K/128]`
    that quantized them (`quantize_weight` of the stacked weight): each expert's FP8 bytes and scales transposed,
    `(q [E, K, N], scale_inv [E, K/128, N/128])`, both contiguous. A 128x128 block's amax, so its scale and its FP8
    values, do not depend on which way it is stored: this equals re-quantizing the weight, bit for bit, from one byte
    read per weight instead of two."""
    e, n, k = q.shape
    if n % BLOCK or k % BLOCK or not q.is_contiguous() or scale_inv.shape != (e, n // BLOCK, k // BLOCK):
        raise ValueError(
            f"transpose_expert_weights: q must be a contiguous [E, N, K] with N and K multiples of {BLOCK} and "
            f"scale_inv [E, N/{BLOCK}, K/{BLOCK}]; got {tuple(q.shape)} and {tuple(scale_inv.shape)}"
        )
    qt = torch.empty(e, k, n, device=q.device, dtype=q.dtype)
    if q.numel():  # moved as bytes: the kernel does no float8 arithmetic
        _transpose_blocks_kernel[(n // BLOCK, k // BLOCK, e)](
            q.view(torch.uint8), qt.view(torch.uint8), n, k, BLOCK=BLOCK, num_warps=8, num_stages=1
        )
    return qt, scale_inv.transpose(1, 2).contiguous()
