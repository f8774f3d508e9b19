"""Grouped blockwise FP8 GEMMs over rows grouped by expert: a mixture-of-experts projection's FProp, DGrad and WGrad
for all experts in one launch each, whatever the number of experts.

Layout (`GroupedRows`): the routed rows, sorted by expert, with each expert's segment zero-padded to a multiple of
128 rows (the layout of DeepGEMM's m-grouped "contiguous" GEMMs). A 128-row group then never spans two experts, so
one `quantize_act` over all padded rows gives, bit for bit, what quantizing each expert's rows on its own gives: the
1x128 groups along features (`rows`) are per row anyway, and the 1x128 groups along tokens (`cols`, WGrad's operand)
are 128 consecutive rows of one expert, its padding zeros (which change no amax and add nothing to a sum). The
quantizer reads the sorted rows through `GroupedRows.source`, so the padded BF16 copy is never written, and the
layout itself is one launch (`_layout_kernel`) from counts that stay on the device. FProp and DGrad run on DeepGEMM's
m-grouped GEMM where it can (`nn.experts.grouped_gemm_kernel`, same operands); `m_grouped_gemm` is the fallback and
the CPU-tested reference.

- `m_grouped_gemm` (FProp `y_e = x_e @ W_e.T`, DGrad `dx_e = dy_e @ W_e`): `a [M_pad, K]` in 1x128 groups along K
  (`quantize_act`'s `rows` layout), `b [E, N, K]` in 128x128 blocks, any strides (DGrad passes `W` transposed: a
  128x128 block is the same block of `W.T`, so the same scales serve both). One program per `BLOCK_M x BLOCK_N` tile
  of the output; the tile's expert comes from its 128-row group, and a tile holding only padding rows returns at once
  (its output rows are left unwritten: callers read the real rows only).
- `k_grouped_gemm` (WGrad `dW_e = dy_e.T @ x_e`): both operands in 1x128 groups along tokens (`quantize_act`'s `cols`
  layout, `[N, M_pad]` and `[K, M_pad]`), each program summing one `BLOCK_N x BLOCK_K` tile of one expert over that
  expert's 128-token groups. An expert without tokens gets zeros.

Math: fp32 accumulation; each 128-deep product `tl.dot(a_q, b_q)` (exact e4m3 products, fp32 sums) is scaled by the
product of A's group scale and B's block (or group) scale and added in fp32: the blockwise math of
`trl_fp8.ops.emulated.gemm` (dequantize, multiply in fp32) but for the order of the fp32 roundings. On CPU (Triton's
interpreter: e4m3 widened exactly, NumPy's fp32 matmul) the difference is fp32 rounding, which
`tests/test_grouped_gemm.py` bounds element by element (`|got - ref| <= K * 2**-23 * (|A| @ |B|.T)` against a float64
reference on the same FP8 operands). On Hopper, as in cuBLAS's and DeepGEMM's blockwise kernels, the tensor cores sum
each 128-deep product with less than fp32 precision before it is promoted to the fp32 accumulator (DeepSeek-V3 reports
about 14 bits), so there the bound is the GPU suite's 4e-3 relative (`tests/gpu/test_grouped_gemm_gpu.py`).

Launch configurations are fixed and simple (no autotuning, so a new token count costs no tuning run): 128x128 output
tiles and 128-deep steps (the scale granularity), 8 warps, 4 pipeline stages; `BLOCK_M=64` with 4 warps when padding
is a quarter or more of the rows; WGrad's caller launches 64-row tiles with 4 warps and 3 stages
(`nn.experts.WGRAD_LAUNCH`). DGrad's B read as the FProp weight transposed (a strided view, N-major) lowers to wgmma
on sm_90, but then only A's loads are asynchronous; so DGrad multiplies each expert's weight re-quantized transposed
(`weight_quant.quantize_expert_weights_t`: `[E, K, N]`, K-major, the same FP8 values and scales). The floor of each
launch at Qwen3-30B-A3B's expert shapes, what the kernels reach of it and how they compile for sm_90:
docs/contributing/engineering-notes.md, "Mixture of experts".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from trl_fp8.kernels._common import BLOCK  # the scale granularity; expert segments are padded to it

__all__ = ["GroupedRows", "k_grouped_gemm", "m_grouped_gemm", "token_maps"]


@triton.jit
def _layout_kernel(
    counts_ptr, offsets_ptr, group_expert_ptr, group_rows_ptr, dest_ptr, source_ptr, expert_of_row_ptr,
    E, G, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """`GroupedRows`' device arrays from the counts: program `gid` fills 128-row group `gid` (`offsets` too, for
    program 0). Each program prefix-sums the counts itself (E <= a few hundred), so one launch needs no other."""
    gid = tl.program_id(0)
    idx = tl.arange(0, BLOCK_E)
    c = tl.load(counts_ptr + idx, mask=idx < E, other=0).to(tl.int32)
    groups = (c + BLOCK - 1) // BLOCK
    ends = tl.cumsum(groups, 0)  # groups up to and including each expert
    starts = ends - groups
    sorted_starts = tl.cumsum(c, 0) - c
    if gid == 0:
        tl.store(offsets_ptr + idx + 1, ends * BLOCK, mask=idx < E)
        tl.store(offsets_ptr, 0)
    if gid < G:
        e = tl.sum((ends <= gid).to(tl.int32), 0)  # the expert whose groups hold this one (E: past the last)
        real_group = e < E
        mine = idx == e
        count = tl.sum(tl.where(mine, c, 0), 0)
        first = tl.sum(tl.where(mine, starts, 0), 0)
        sorted_start = tl.sum(tl.where(mine, sorted_starts, 0), 0)
        n_real = tl.where(real_group, tl.minimum(tl.maximum(count - BLOCK * (gid - first), 0), BLOCK), 0)
        tl.store(group_expert_ptr + gid, tl.minimum(e, E - 1))
        tl.store(group_rows_ptr + gid, n_real)
        i = tl.arange(0, BLOCK)
        row = gid.to(tl.int64) * BLOCK + i
        real = i < n_real
        src = sorted_start + BLOCK * (gid - first) + i
        tl.store(source_ptr + row, tl.where(real, src, -1))
        tl.store(expert_of_row_ptr + row, tl.where(real, e, -1))
        tl.store(dest_ptr + src.to(tl.int64), row, mask=real)


class GroupedRows:
    """Where each expert's rows sit in the padded layout, for `counts[e]` rows of expert e sorted by expert.

    `counts`: host integers, or an integer tensor on the device (with `num_rows`, their sum): then the layout is built
    without the host waiting for the GPU (a MoE layer in the middle of a forward), and `m_pad` is an upper bound on
    the padded rows (`(num_rows + 127 E) / 128` groups, at most `num_rows`); the groups past the last expert's hold
    no rows, which every kernel skips. Host side: `num_experts`, `num_rows` (real rows), `m_pad` and `block_m` (the
    Triton m-grouped tile height chosen for the expected padding). Device side: `offsets [E + 1]` (segment starts in
    the padded layout, multiples of 128), `group_expert` and `group_rows` `[m_pad / 128]` (the expert of each 128-row
    group and how many of its rows are real), `dest [num_rows]` (the padded row of each sorted row) and `source
    [m_pad]` (the sorted row of each padded row, -1 for padding).
    """

    def __init__(self, counts: Sequence[int] | torch.Tensor, device: torch.device, *, num_rows: int | None = None):
        device = torch.device(device)
        if isinstance(counts, torch.Tensor):
            if num_rows is None:
                raise ValueError("GroupedRows: a tensor of counts needs num_rows (their sum, known on the host)")
            c = counts.to(device=device, dtype=torch.int64)
            self._counts = None
            self.num_experts, self.num_rows = c.numel(), int(num_rows)
            self.m_pad = BLOCK * min((self.num_rows + (BLOCK - 1) * self.num_experts) // BLOCK, self.num_rows)
            # Half-height tiles when padding is expected to be a quarter or more of the rows (few rows per expert).
            self.block_m = 64 if self.num_rows < 192 * self.num_experts else BLOCK
        else:
            self._counts = tuple(int(n) for n in counts)
            c = torch.tensor(self._counts, dtype=torch.int64, device=device)
            self.num_experts, self.num_rows = len(self._counts), sum(self._counts)
            self.m_pad = BLOCK * sum((n + BLOCK - 1) // BLOCK for n in self._counts)
            self.block_m = 64 if self.m_pad and self.num_rows < 0.75 * self.m_pad else BLOCK
        self._c = c
        e, g = self.num_experts, self.m_pad // BLOCK
        self.offsets = torch.empty(e + 1, device=device, dtype=torch.int32)
        self.group_expert = torch.empty(g, device=device, dtype=torch.int32)
        self.group_rows = torch.empty(g, device=device, dtype=torch.int32)
        self.dest = torch.empty(self.num_rows, device=device, dtype=torch.int64)
        # The sorted row behind each padded row (-1: padding): what `quantize_act(source_rows=...)` reads, so that
        # the padded copy of the rows is never written; and each padded row's expert (-1: padding).
        self.source = torch.empty(self.m_pad, device=device, dtype=torch.int32)
        self.expert_of_row = torch.empty(self.m_pad, device=device, dtype=torch.int32)
        # One launch (a program per 128-row group, each summing the counts itself): a layer's host time matters.
        _layout_kernel[(max(g, 1),)](
            c, self.offsets, self.group_expert, self.group_rows, self.dest, self.source, self.expert_of_row, e, g,
            BLOCK_E=triton.next_power_of_2(max(e, 1)), BLOCK=BLOCK,
        )  # fmt: skip

    @property
    def counts(self) -> tuple[int, ...]:
        """Rows per expert, on the host (from a tensor of counts, this waits for the GPU)."""
        if self._counts is None:
            self._counts = tuple(self._c.tolist())
        return self._counts

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """`x [num_rows, K]` (sorted by expert) in the padded layout `[m_pad, K]`, padding rows zero."""
        return x.new_zeros(self.m_pad, x.shape[1]).index_copy_(0, self.dest, x)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """The real rows of a padded `y [m_pad, N]`, in sorted order."""
        return y.index_select(0, self.dest)


@triton.jit
def _token_maps_kernel(order_ptr, dest_ptr, pos_ptr, slot_rows_ptr, token_ptr, R, TOP_K, BLOCK: tl.constexpr):
    s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    real = s < R
    pair = tl.load(order_ptr + s, mask=real, other=0).to(tl.int64)  # the (token, slot) pair of sorted row s
    row = tl.load(dest_ptr + s, mask=real, other=0)
    tl.store(pos_ptr + pair, s, mask=real)
    tl.store(slot_rows_ptr + pair, row, mask=real)
    tl.store(token_ptr + row, (pair // TOP_K).to(tl.int32), mask=real)


def token_maps(rows: GroupedRows, order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each routed row sits, for rows sorted by expert as `order` sorts the (token, slot) pairs (`order[s] = t *
    top_k + j` for sorted row s): `(pos [tokens, top_k]` its sorted row, `slot_rows [tokens, top_k]` its row in the
    padded layout, `token_of_row [m_pad]` int32 the token of each padded row, -1 for padding`)`, in two launches."""
    n = rows.num_rows
    if order.numel() != n or n % top_k:
        raise ValueError(f"token_maps: {order.numel()} pairs for {n} rows of top-{top_k} routing")
    pos = torch.empty(n, device=order.device, dtype=torch.int64)
    slot_rows = torch.empty(n, device=order.device, dtype=torch.int64)
    token_of_row = torch.full((rows.m_pad,), -1, device=order.device, dtype=torch.int32)
    if n:
        _token_maps_kernel[(triton.cdiv(n, 1024),)](
            order, rows.dest, pos, slot_rows, token_of_row, n, top_k, BLOCK=1024, num_warps=4
        )
    return pos.view(-1, top_k), slot_rows.view(-1, top_k), token_of_row


@triton.jit
def _m_grouped_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, group_expert_ptr, group_rows_ptr,
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Grouped program order (GROUP_M row tiles share the column tiles they read), as in Triton's matmul tutorial.
    pid = tl.program_id(0)
    num_pid_m = M // BLOCK_M
    num_pid_n = N // BLOCK_N
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    row0 = pid_m * BLOCK_M
    group = row0 // BLOCK
    if row0 % BLOCK >= tl.load(group_rows_ptr + group):
        return  # padding rows only: no caller reads them
    e = tl.load(group_expert_ptr + group).to(tl.int64)

    rm = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + e * stride_be + rk[:, None] * stride_bk + rn[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + e * stride_bse + (rn // BLOCK) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        a_s = tl.load(as_ptrs + kb * stride_ask)
        b_s = tl.load(bs_ptrs + kb * stride_bsk)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]  # one 128-deep block, scaled, added in fp32
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty))


@triton.jit
def _k_grouped_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, offsets_ptr,
    N, K,
    stride_an, stride_at, stride_asn, stride_asg,
    stride_bk, stride_bt, stride_bsk, stride_bsg,
    stride_ce, stride_cn, stride_ck,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # the output tile within the expert: consecutive programs share the expert's tokens
    e = tl.program_id(1)
    num_pid_k = K // BLOCK_K
    pid_n = pid // num_pid_k
    pid_k = pid % num_pid_k
    start = tl.multiple_of(tl.load(offsets_ptr + e), BLOCK_T)  # (segments start at multiples of it: aligned loads)
    num_steps = (tl.load(offsets_ptr + e + 1) - start) // BLOCK_T

    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rt = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
    a_ptrs = a_ptr + rn[:, None] * stride_an + rt[None, :] * stride_at  # [BLOCK_N, BLOCK_T]
    b_ptrs = b_ptr + rt[:, None] * stride_bt + rk[None, :] * stride_bk  # [BLOCK_T, BLOCK_K]
    group0 = (start // BLOCK_T).to(tl.int64)
    as_ptrs = as_ptr + rn * stride_asn + group0 * stride_asg
    bs_ptrs = bs_ptr + rk * stride_bsk + group0 * stride_bsg
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(0, num_steps):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        a_s = tl.load(as_ptrs + i * stride_asg)
        b_s = tl.load(bs_ptrs + i * stride_bsg)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]  # one 128-token group, scaled, added in fp32
        a_ptrs += BLOCK_T * stride_at
        b_ptrs += BLOCK_T * stride_bt
    c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rn[:, None] * stride_cn + rk[None, :] * stride_ck
    if ACCUMULATE:  # c += acc, rounded once; an expert without tokens leaves its tile as it is
        if num_steps > 0:
            tl.store(c_ptrs, (tl.load(c_ptrs).to(tl.float32) + acc).to(c_ptr.dtype.element_ty))
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))


@triton.jit
def _k_grouped_persistent_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, group_expert_ptr, group_rows_ptr,
    N, K, G,
    stride_an, stride_at, stride_asn, stride_asg,
    stride_bk, stride_bt, stride_bsk, stride_bsg,
    stride_ce, stride_cn, stride_ck,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """One program per output tile, for every expert: one loop over all 128-token groups (long enough to keep the
    loads pipelined, where a program per expert sums 2-4 groups), storing the tile at each expert's last group."""
    pid = tl.program_id(0)
    num_pid_k = K // BLOCK_K
    pid_n = pid // num_pid_k
    pid_k = pid % num_pid_k
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rt = tl.arange(0, BLOCK_T).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for g in range(0, G):
        tokens = g * BLOCK_T + rt  # int64, as rt
        a = tl.load(a_ptr + rn[:, None] * stride_an + tokens[None, :] * stride_at)
        b = tl.load(b_ptr + tokens[:, None] * stride_bt + rk[None, :] * stride_bk)
        a_s = tl.load(as_ptr + rn * stride_asn + g * stride_asg)
        b_s = tl.load(bs_ptr + rk * stride_bsk + g * stride_bsg)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        e = tl.load(group_expert_ptr + g)
        # The expert's last group: there is no next group, or it is another expert's, or it holds no rows (the
        # layout's trailing groups, past the last expert). (The next group's index is clamped: always a valid load.)
        following = tl.minimum(g + 1, G - 1)
        next_e, next_rows = tl.load(group_expert_ptr + following), tl.load(group_rows_ptr + following)
        last = (g + 1 >= G) | (next_e != e) | (next_rows == 0)
        if last & (tl.load(group_rows_ptr + g) > 0):
            c_ptrs = c_ptr + e.to(tl.int64) * stride_ce + rn[:, None] * stride_cn + rk[None, :] * stride_ck
            if ACCUMULATE:
                tl.store(c_ptrs, (tl.load(c_ptrs).to(tl.float32) + acc).to(c_ptr.dtype.element_ty))
            else:
                tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit
def _zero_empty_experts_kernel(c_ptr, offsets_ptr, NK, BLOCK: tl.constexpr):
    """Zeros of the experts without tokens (a segment of length 0), which the persistent WGrad never visits."""
    e = tl.program_id(0)
    if tl.load(offsets_ptr + e + 1) == tl.load(offsets_ptr + e):
        i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(c_ptr + e.to(tl.int64) * NK + i, tl.zeros((BLOCK,), dtype=c_ptr.dtype.element_ty), mask=i < NK)


def m_grouped_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    rows: GroupedRows,
    out_dtype: torch.dtype,
    *,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 4,
) -> torch.Tensor:
    """`out[r] = a[r] @ b[e].T` for every real row r of expert e in the padded layout `rows`.

    `a_q [m_pad, K]` float8_e4m3fn with `a_s [m_pad, K/128]` (1x128 groups along K), `b_q [E, N, K]` float8_e4m3fn
    with `b_s [E, N/128, K/128]` (128x128 blocks); any strides (DGrad passes `W.transpose(1, 2)` and its scales
    likewise). Returns `out [m_pad, N]` in `out_dtype`; rows of padding are left unwritten where a whole tile is
    padding. `block_m` (64 or 128; default `rows.block_m`), `num_warps` and `num_stages` change only how it runs."""
    m, k = a_q.shape
    e, n, kb = b_q.shape
    block_m = block_m or rows.block_m
    if kb != k or m != rows.m_pad or e != rows.num_experts or n % BLOCK or k % BLOCK or BLOCK % block_m:
        raise ValueError(
            f"m_grouped_gemm: a {tuple(a_q.shape)} and b {tuple(b_q.shape)} do not fit a {rows.m_pad}-row layout of "
            f"{rows.num_experts} experts (N and K multiples of {BLOCK}, block_m dividing {BLOCK}; got {block_m})."
        )
    out = torch.empty(m, n, device=a_q.device, dtype=out_dtype)
    if m:
        grid = ((m // block_m) * (n // BLOCK),)
        _m_grouped_kernel[grid](
            a_q, a_s, b_q, b_s, out, rows.group_expert, rows.group_rows,
            m, n, k,
            a_q.stride(0), a_q.stride(1), a_s.stride(0), a_s.stride(1),
            b_q.stride(0), b_q.stride(1), b_q.stride(2), b_s.stride(0), b_s.stride(1), b_s.stride(2),
            out.stride(0), out.stride(1),
            BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=BLOCK, GROUP_M=8, BLOCK=BLOCK,
            num_warps=num_warps or (8 if block_m == BLOCK else 4), num_stages=num_stages,
        )  # fmt: skip
    return out


def k_grouped_gemm(
    a_qt: torch.Tensor,
    a_st: torch.Tensor,
    b_qt: torch.Tensor,
    b_st: torch.Tensor,
    rows: GroupedRows,
    out_dtype: torch.dtype,
    *,
    block_n: int = BLOCK,
    num_warps: int = 8,
    num_stages: int = 4,
    accumulate_into: torch.Tensor | None = None,
    persistent: bool = False,
) -> torch.Tensor:
    """`out[e] = a[:, tokens of e] @ b[:, tokens of e].T` for every expert e: WGrad `dW_e = dy_e.T @ x_e`.

    `a_qt [N, m_pad]` and `b_qt [K, m_pad]` float8_e4m3fn with `a_st [N, m_pad/128]`, `b_st [K, m_pad/128]` (1x128
    groups along tokens: `quantize_act`'s `cols` layout of the padded `dy` and `x`), any strides. Returns
    `out [E, N, K]` in `out_dtype`, zeros for experts without tokens. `num_warps` and `num_stages` change only how
    it runs, as does `block_n` (the output tile's height: 128, or 64 for less register pressure).

    `accumulate_into`: a contiguous `[E, N, K]` tensor (a weight's `.grad`) that each expert's product is added to in
    place, in fp32 and rounded once to its dtype, and which is returned; experts without tokens leave theirs as it
    is. It reads and writes the gradient once, where returning the product for autograd to add writes it, then reads
    both and writes the sum.

    `persistent`: one program per output tile looping over every 128-token group, storing at each expert's last
    (`_k_grouped_persistent_kernel`), instead of a program per tile and expert: the same sums in the same order, so
    the same values; which runs faster is measured (`benchmarks/bench_grouped_gemm.py --sweep`)."""
    n, m = a_qt.shape
    k, mb = b_qt.shape
    if mb != m or m != rows.m_pad or n % BLOCK or k % BLOCK:
        raise ValueError(
            f"k_grouped_gemm: a {tuple(a_qt.shape)} and b {tuple(b_qt.shape)} do not fit a {rows.m_pad}-row layout "
            f"(N and K multiples of {BLOCK})."
        )
    shape = (rows.num_experts, n, k)
    if accumulate_into is not None and (tuple(accumulate_into.shape) != shape or not accumulate_into.is_contiguous()):
        raise ValueError(f"k_grouped_gemm: accumulate_into must be a contiguous {shape} tensor, got "
                         f"{tuple(accumulate_into.shape)} with strides {accumulate_into.stride()}")  # fmt: skip
    if not m:  # no tokens at all (and no operand memory to point the kernel at)
        return accumulate_into if accumulate_into is not None else torch.zeros(shape, device=a_qt.device,
                                                                                dtype=out_dtype)  # fmt: skip
    out = accumulate_into if accumulate_into is not None else torch.empty(shape, device=a_qt.device, dtype=out_dtype)
    if not out.numel():
        return out
    strides = (
        a_qt.stride(0),
        a_qt.stride(1),
        a_st.stride(0),
        a_st.stride(1),
        b_qt.stride(0),
        b_qt.stride(1),
        b_st.stride(0),
        b_st.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
    )
    meta = dict(BLOCK_N=block_n, BLOCK_K=BLOCK, BLOCK_T=BLOCK, ACCUMULATE=accumulate_into is not None,
                num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    tiles = (n // block_n) * (k // BLOCK)
    if persistent:
        if accumulate_into is None:  # the experts without tokens, which the persistent loop never visits
            _zero_empty_experts_kernel[(rows.num_experts, triton.cdiv(n * k, 4096))](
                out, rows.offsets, n * k, BLOCK=4096, num_warps=4
            )
        _k_grouped_persistent_kernel[(tiles,)](
            a_qt, a_st, b_qt, b_st, out, rows.group_expert, rows.group_rows, n, k, m // BLOCK, *strides, **meta
        )
    else:
        _k_grouped_kernel[(tiles, rows.num_experts)](a_qt, a_st, b_qt, b_st, out, rows.offsets, n, k, *strides, **meta)
    return out
