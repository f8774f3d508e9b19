"""The grouped blockwise FP8 GEMMs (`trl_fp8.kernels.grouped_gemm`) and the FP8 experts that run on them.

On CPU the kernels run in Triton's interpreter (conftest sets `TRITON_INTERPRET=1`), which executes the kernel code
itself (every index, stride, tile-to-expert mapping and scale step) with NumPy. Its `tl.dot` widens e4m3 operands to
fp16 (exact: every e4m3 value is an fp16 value, checked below) and multiplies in fp32, so the FP8 dot runs as written,
with no dequantization added for the interpreter. Its float32 -> bf16 and -> e4m3 casts truncate; the
`exact_interpreter_casts` fixture (conftest) swaps in round-to-nearest-even, as the GPU does.

Bounds:
- kernels against a float64 loop over experts on the same FP8 operands: element by element,
  `|got - ref| <= K * 2**-23 * (|A| @ |B|.T)` (fp32 summation of K exact products, the per-block scaling and the block
  sums: a few K * 2**-24 at most), plus one bf16 rounding (`2**-8 * |ref|`) for bf16 outputs; the same bound doubled
  against the emulation (`trl_fp8.ops.emulated.gemm`, which rounds in fp32 too). On a GPU the tensor cores' reduced
  precision inside each 128-deep block gives way to the GPU suite's 4e-3 relative bound.
- one projection's autograd function, grouped against the loop on the emulation, from the same rows, weight and
  output gradient: y, dx and dW are each one GEMM of identical FP8 operands, so the kernel bound holds element by
  element (doubled, both sides rounding in fp32; plus one bf16 rounding for bf16).
- a whole FP8 experts layer (two projections and the gate between them), grouped against the loop: relative error of
  the output and of every gradient below 1e-4. Not element by element: the first GEMM's fp32 rounding differences
  (~1e-7) now and then move a value of gate_up's output (or of down_proj's input gradient) across an e4m3 rounding
  boundary when the next GEMM quantizes it, and that token's whole row then differs by an FP8 step in one element or
  one group's scale. Measured here: 3e-7 to 2.2e-5 relative, from one or two such rows in 40 or 200 tokens.
"""

import numpy as np
import pytest
import torch

from trl_fp8 import FP8LinearConfig
from trl_fp8.ops import emulated
from trl_fp8.quantization import dequantize_blocks, dequantize_groups, quantize_act_layouts

from conftest import rel_err

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from trl_fp8 import kernels  # noqa: E402
from trl_fp8.kernels.grouped_gemm import GroupedRows, k_grouped_gemm, m_grouped_gemm  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")

COUNTS = [0, 3, 130, 0, 128]  # uneven; experts without tokens, first and inside; one, two and exactly one group
F64 = torch.float64
CUDA = torch.cuda.is_available()


def _device():
    return "cuda" if CUDA else "cpu"


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _rows(counts=COUNTS):
    return GroupedRows(counts, torch.device(_device()))


def _segments(rows):
    offsets = rows.offsets.tolist()
    return [(offsets[e], offsets[e] + c) for e, c in enumerate(rows.counts)]  # each expert's real rows, padded layout


def _check(got, ref, abs_product, k, factor=1.0, ref_in_bf16=False):
    """`got` (fp32 or bf16) against `ref` (float64), element by element (see the module docstring): `factor` times
    the fp32 summation bound, plus a bf16 rounding of `got` (half a bf16 step, at most 2**-8 relative) and, with
    `ref_in_bf16`, one of `ref` too."""
    if CUDA:
        assert rel_err(got, ref) < 4e-3
        return
    bound = factor * k * 2**-23 * abs_product
    if got.dtype == torch.bfloat16:
        bound = bound + (2 if ref_in_bf16 else 1) * 2**-8 * ref.abs()
    err = (got.double() - ref).abs()
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.skipif(CUDA, reason="the interpreter's premise; the GPU runs compiled kernels")
def test_interpreter_dot_widens_every_e4m3_value_exactly():
    from triton.runtime import interpreter

    codes = np.arange(256, dtype=np.uint8)
    widened = interpreter._convert_float(codes, tl.float8e4nv, tl.float16, None).view(np.float16)
    exact = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).to(torch.float16).numpy()
    finite = ~np.isnan(exact)  # 0x7f and 0xff (NaN) never leave the quantizers, which saturate at 448
    assert (widened[finite] == exact[finite]).all()


def test_grouped_rows_pad_each_expert_to_128_rows_and_one_quantization_equals_each_experts_own():
    rows = _rows()
    assert rows.m_pad == 0 + 128 + 256 + 0 + 128 and rows.num_rows == sum(COUNTS)
    assert rows.offsets.tolist() == [0, 0, 128, 384, 384, 512]
    assert rows.group_expert.tolist() == [1, 2, 2, 4] and rows.group_rows.tolist() == [3, 128, 2, 128]
    assert rows.block_m == 64 and GroupedRows([128, 0, 100], "cpu").block_m == 128  # 64-row tiles: much padding
    x = torch.randn(sum(COUNTS), 256, device=_device())
    padded = rows.pad(x)
    assert torch.equal(rows.unpad(padded), x)
    real = torch.zeros(rows.m_pad, dtype=torch.bool, device=x.device)
    real[rows.dest] = True
    assert not padded[~real].any()
    act = kernels.quantize_act(padded, rows=True, cols=True)
    start = 0
    for (lo, hi), c in zip(_segments(rows), COUNTS, strict=True):
        if not c:
            continue
        own = quantize_act_layouts(x[start : start + c], rows=True, cols=True)  # one expert, padded on its own
        pad_hi = lo + own.q.shape[0]
        assert torch.equal(_bits(act.q[lo:hi]), _bits(own.q[:c])) and torch.equal(
            act.scale_inv[lo:hi], own.scale_inv[:c]
        )
        assert torch.equal(_bits(act.qt[:, lo:pad_hi]), _bits(own.qt))
        assert torch.equal(act.scale_inv_t[:, lo // 128 : pad_hi // 128], own.scale_inv_t)
        start += c


def test_quantizing_the_sorted_rows_through_the_source_map_equals_quantizing_the_padded_copy():
    """`quantize_act(x, source_rows=rows.source)` reads the sorted rows straight into the padded layout: bit for bit
    the quantization of `rows.pad(x)`, in both layouts; `expert_of_row` names each padded row's expert (-1:
    padding), as DeepGEMM's grouped kernel reads it."""
    rows = _rows()
    x = torch.randn(rows.num_rows, 256, device=_device())
    x[:, 128:] *= 1e-3
    padded = kernels.quantize_act(rows.pad(x), rows=True, cols=True)
    gathered = kernels.quantize_act(x, source_rows=rows.source, rows=True, cols=True)
    for a, b in zip(padded, gathered, strict=True):
        assert a.shape == b.shape and torch.equal(_bits(a) if a.dtype != torch.float32 else a, _bits(b) if
                                                  b.dtype != torch.float32 else b)  # fmt: skip
    expected = torch.full((rows.m_pad,), -1, dtype=torch.int32)
    for e, (lo, hi) in enumerate(_segments(rows)):
        expected[lo:hi] = e
    assert torch.equal(rows.expert_of_row.cpu(), expected)
    with pytest.raises(ValueError, match="cols_second_read"):
        kernels.quantize_act(x, source_rows=rows.source, cols=True, cols_second_read=True)


def test_layout_from_counts_on_the_device_bounds_the_padding_and_places_every_row_alike():
    """From a tensor of counts (no host sync) `m_pad` is an upper bound; the rows land where host counts put them,
    the extra groups hold no rows (zero `group_rows`, -1 in `source` and `expert_of_row`), and one projection's
    grouped forward and backward on that layout equal the exact layout's."""
    from trl_fp8.nn.experts import _GroupedExpertsFP8Matmul

    exact = _rows()
    rows = GroupedRows(torch.tensor(COUNTS, device=_device()), _device(), num_rows=sum(COUNTS))
    assert rows.m_pad >= exact.m_pad and rows.m_pad % 128 == 0 and rows.counts == tuple(COUNTS)
    assert torch.equal(rows.offsets, exact.offsets) and torch.equal(rows.dest, exact.dest)
    groups = exact.m_pad // 128
    assert torch.equal(rows.group_rows[:groups], exact.group_rows) and not rows.group_rows[groups:].any()
    assert torch.equal(rows.group_expert[:groups], exact.group_expert)
    assert torch.equal(rows.source[: exact.m_pad], exact.source) and (rows.source[exact.m_pad :] == -1).all()
    assert (rows.expert_of_row[exact.m_pad :] == -1).all()
    with pytest.raises(ValueError, match="num_rows"):
        GroupedRows(torch.tensor(COUNTS), "cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), 256, generator=g).to(_device())
    w = (torch.randn(5, 128, 256, generator=g) * 0.05).to(_device())
    dy = torch.randn(sum(COUNTS), 128, generator=g).to(_device())
    q, s = kernels.quantize_weight(w.reshape(5 * 128, 256))
    q, s = q.view(5, 128, 256), s.view(5, 1, 2)
    results = []
    for layout in (exact, rows):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = _GroupedExpertsFP8Matmul.apply(xg, wg, q, s, layout, "triton", False, True)
        y.backward(dy)
        results.append((y, xg.grad, wg.grad))
    for got, ref in zip(*results, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("num_experts,num_rows", [(128, 2048), (3, 300), (2, 0)])
def test_layout_kernel_matches_the_layout_written_out_by_hand(num_experts, num_rows):
    """The one-launch layout against the definition: each expert's segment starts at the previous one's end rounded
    up to 128 rows; sorted row j of expert e sits at its segment start plus j's rank within e."""
    g = torch.Generator().manual_seed(num_experts)
    counts = torch.bincount(torch.randint(0, num_experts, (num_rows,), generator=g), minlength=num_experts).tolist()
    offsets, dest = [0], []
    for c in counts:
        dest += range(offsets[-1], offsets[-1] + c)
        offsets.append(offsets[-1] + -(-c // 128) * 128)
    for rows in (GroupedRows(counts, _device()), GroupedRows(torch.tensor(counts), _device(), num_rows=num_rows)):
        assert rows.offsets.tolist() == offsets and rows.dest.tolist() == dest
        source = torch.full((rows.m_pad,), -1)
        source[dest] = torch.arange(num_rows)
        assert torch.equal(rows.source.long().cpu(), source)


def test_expert_weights_transposed_per_expert_are_the_row_major_blocks_bit_for_bit():
    from trl_fp8.kernels.weight_quant import quantize_expert_weights_t

    e, n, k = 3, 256, 384
    w = torch.randn(e, n, k, device=_device())
    w[1] *= 100  # experts of different magnitudes
    q, s = kernels.quantize_weight(w.reshape(e * n, k))
    q_t, s_t = quantize_expert_weights_t(w)
    assert q_t.shape == (e, k, n) and s_t.shape == (e, k // 128, n // 128) and q_t.is_contiguous()
    assert torch.equal(_bits(q_t), _bits(q.view(e, n, k).transpose(1, 2)))
    assert torch.equal(s_t, s.view(e, n // 128, k // 128).transpose(1, 2))
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_expert_weights_t(w[:, :200])


def test_cached_expert_blocks_transposed_equal_the_requantized_dgrad_operand():
    """DGrad's operand moved from the cached row-major blocks (`transpose_expert_weights`) is the re-quantized one,
    bit for bit: FP8 bytes and scales."""
    from trl_fp8.kernels.weight_quant import quantize_expert_weights_t, transpose_expert_weights

    e, n, k = 3, 256, 384
    w = torch.randn(e, n, k, device=_device())
    w[1] *= 100
    w[2, :128, :128] = 0  # an all-zero block
    q, s = kernels.quantize_weight(w.reshape(e * n, k))
    q_t, s_t = transpose_expert_weights(q.view(e, n, k), s.view(e, n // 128, k // 128))
    ref_q, ref_s = quantize_expert_weights_t(w)
    assert q_t.shape == (e, k, n) and q_t.is_contiguous() and s_t.is_contiguous()
    assert torch.equal(_bits(q_t), _bits(ref_q)) and torch.equal(s_t, ref_s)
    with pytest.raises(ValueError, match="contiguous"):
        transpose_expert_weights(q.view(e, n, k)[:, :, :256], s.view(e, n // 128, k // 128))


def _operands(a_cols, n, k, seed=0):
    """The layout, the padded rows `[num_rows, a_cols]` quantized in both layouts, and the weights `[E * n, k]`."""
    g = torch.Generator().manual_seed(seed)
    rows = _rows()
    e = rows.num_experts
    x = torch.randn(rows.num_rows, a_cols, generator=g)
    x[:, :128] *= 1e-2  # groups of different magnitudes
    w = torch.randn(e * n, k, generator=g) * 0.05
    w[: 128 * e] *= 10  # blocks of different magnitudes
    act = kernels.quantize_act(rows.pad(x.to(_device())), rows=True, cols=True)
    return rows, act, w.to(_device())


@pytest.mark.parametrize(
    "orientation,out_dtype,block_m",
    [("fprop", torch.float32, 128), ("fprop", torch.bfloat16, 64), ("dgrad_view", torch.float32, 64),
     ("dgrad_col_major", torch.bfloat16, 128)],
)  # fmt: skip
def test_m_grouped_gemm_matches_a_loop_over_experts(orientation, out_dtype, block_m):
    """FProp `x_e @ W_e.T` and DGrad `dy_e @ W_e`: DGrad's B is `W` transposed, either the FProp weight read
    transposed (a strided view) or the column-major re-quantization (K-major), the same 128x128 blocks."""
    n, k = 256, 384  # W_e [n, k]
    e = len(COUNTS)
    if orientation == "fprop":
        rows, act, w = _operands(k, n, k)
        q, s = kernels.quantize_weight(w)
        b_q, b_s = q.view(e, n, k), s.view(e, n // 128, k // 128)
    else:
        rows, act, w = _operands(n, n, k)  # A: dy [rows, n]
        q, s = kernels.quantize_weight(w, col_major=orientation == "dgrad_col_major")
        b_q, b_s = q.view(e, n, k).transpose(1, 2), s.view(e, n // 128, k // 128).transpose(1, 2)
        if orientation == "dgrad_col_major":
            assert b_q.stride(2) == 1  # K-major: the reduction (over n) runs along memory
    got = m_grouped_gemm(act.q, act.scale_inv, b_q, b_s, rows, out_dtype, block_m=block_m)
    assert got.shape == (rows.m_pad, b_q.shape[1]) and got.dtype == out_dtype
    a = dequantize_groups(act.q, act.scale_inv, dtype=F64)
    for expert, (lo, hi) in enumerate(_segments(rows)):
        if lo == hi:
            continue
        b = dequantize_blocks(b_q[expert], b_s[expert], dtype=F64)
        ref = a[lo:hi] @ b.t()
        red = b.shape[1]
        _check(got[lo:hi], ref, a[lo:hi].abs() @ b.abs().t(), red)
        emu = emulated.gemm(act.q[lo:hi], act.scale_inv[lo:hi], b_q[expert], b_s[expert], True, torch.float32)
        _check(got[lo:hi], emu.double(), a[lo:hi].abs() @ b.abs().t(), red, factor=2.0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_k_grouped_gemm_matches_a_loop_over_experts(out_dtype):
    """WGrad `dy_e.T @ x_e` over each expert's 128-token groups; experts without tokens get zeros."""
    n, k = 256, 384
    rows, x, _ = _operands(k, n, k)
    dy = kernels.quantize_act(rows.pad(torch.randn(rows.num_rows, n, device=_device())), rows=False, cols=True)
    got = k_grouped_gemm(dy.qt, dy.scale_inv_t, x.qt, x.scale_inv_t, rows, out_dtype)
    assert got.shape == (len(COUNTS), n, k) and got.dtype == out_dtype
    a = dequantize_groups(dy.qt, dy.scale_inv_t, dtype=F64)
    b = dequantize_groups(x.qt, x.scale_inv_t, dtype=F64)
    offsets = rows.offsets.tolist()
    for expert in range(len(COUNTS)):
        lo, hi = offsets[expert], offsets[expert + 1]  # the padded segment: whole 128-token groups
        if lo == hi:
            assert not got[expert].any()
            continue
        ref = a[:, lo:hi] @ b[:, lo:hi].t()
        _check(got[expert], ref, a[:, lo:hi].abs() @ b[:, lo:hi].abs().t(), hi - lo)
        emu = emulated.gemm(dy.qt[:, lo:hi], dy.scale_inv_t[:, lo // 128 : hi // 128], x.qt[:, lo:hi],
                            x.scale_inv_t[:, lo // 128 : hi // 128], False, torch.float32)  # fmt: skip
        _check(got[expert], emu.double(), a[:, lo:hi].abs() @ b[:, lo:hi].abs().t(), hi - lo, factor=2.0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_k_grouped_gemm_accumulates_into_a_gradient_in_place(out_dtype):
    """`accumulate_into`: each expert's product added to the tensor given (a weight's `.grad`), in fp32 and rounded
    once; an expert without tokens keeps what it held. Bound: the product's fp32 summation bound plus one rounding of
    the sum to `out_dtype`."""
    n, k = 256, 384
    rows, x, _ = _operands(k, n, k)
    dy = kernels.quantize_act(rows.pad(torch.randn(rows.num_rows, n, device=_device())), rows=False, cols=True)
    before = torch.randn(len(COUNTS), n, k, device=_device()).to(out_dtype)
    grad = before.clone()
    got = k_grouped_gemm(dy.qt, dy.scale_inv_t, x.qt, x.scale_inv_t, rows, out_dtype, accumulate_into=grad)
    assert got is grad
    a = dequantize_groups(dy.qt, dy.scale_inv_t, dtype=F64)
    b = dequantize_groups(x.qt, x.scale_inv_t, dtype=F64)
    offsets = rows.offsets.tolist()
    for expert in range(len(COUNTS)):
        lo, hi = offsets[expert], offsets[expert + 1]
        if lo == hi:
            assert torch.equal(got[expert], before[expert])
            continue
        ref = before[expert].double() + a[:, lo:hi] @ b[:, lo:hi].t()
        if CUDA:
            assert rel_err(got[expert], ref) < 4e-3
            continue
        rounding = 2**-8 if out_dtype == torch.bfloat16 else 2**-24  # the sum's one rounding to out_dtype
        bound = (hi - lo) * 2**-23 * (a[:, lo:hi].abs() @ b[:, lo:hi].abs().t()) + rounding * ref.abs()
        assert ((got[expert].double() - ref).abs() <= bound).all()
    with pytest.raises(ValueError, match="contiguous"):
        k_grouped_gemm(dy.qt, dy.scale_inv_t, x.qt, x.scale_inv_t, rows, out_dtype,
                       accumulate_into=grad.transpose(1, 2).contiguous().transpose(1, 2))  # fmt: skip


@pytest.mark.parametrize("counts_on_device", [False, True])
def test_persistent_wgrad_equals_a_program_per_expert(counts_on_device):
    """`k_grouped_gemm(persistent=True)`: one program per output tile looping over every group sums each expert's
    groups in the same order as a program per tile and expert, so both give the same values bit for bit, written or
    accumulated; experts without tokens get zeros (written) or keep theirs (accumulated), also in a layout built from
    counts on the device, whose trailing groups hold no rows."""
    n, k = 256, 384
    g = torch.Generator().manual_seed(7)
    counts = [0, 3, 130, 0, 128]
    if counts_on_device:
        rows = GroupedRows(torch.tensor(counts, device=_device()), torch.device(_device()), num_rows=sum(counts))
        assert rows.m_pad > 128 * sum((c + 127) // 128 for c in counts)  # trailing groups without rows
    else:
        rows = GroupedRows(counts, torch.device(_device()))
    x = kernels.quantize_act(torch.randn(rows.num_rows, k, generator=g).to(_device()), source_rows=rows.source,
                             rows=False, cols=True)  # fmt: skip
    dy = kernels.quantize_act(torch.randn(rows.num_rows, n, generator=g).to(_device()), source_rows=rows.source,
                              rows=False, cols=True)  # fmt: skip
    args = (dy.qt, dy.scale_inv_t, x.qt, x.scale_inv_t, rows, torch.float32)
    launch = dict(block_n=64, num_warps=4, num_stages=3)
    assert torch.equal(k_grouped_gemm(*args, persistent=True, **launch), k_grouped_gemm(*args, **launch))
    before = torch.randn(len(counts), n, k, generator=g).to(_device())
    into = [before.clone(), before.clone()]
    k_grouped_gemm(*args, accumulate_into=into[0], persistent=True, **launch)
    k_grouped_gemm(*args, accumulate_into=into[1], **launch)
    assert torch.equal(into[0], into[1]) and torch.equal(into[0][[0, 3]], before[[0, 3]])


def test_token_maps_invert_the_sort_and_name_each_padded_rows_token():
    """`token_maps`: each (token, slot)'s sorted row (the inverse of the sort), its padded row, and each padded row's
    token (-1 for padding), against the same maps built with torch indexing."""
    from trl_fp8.kernels.grouped_gemm import token_maps

    g = torch.Generator().manual_seed(2)
    top_k, tokens = 3, sum(COUNTS) // 3  # 261 routed rows: 87 tokens of 3 slots
    assert top_k * tokens == sum(COUNTS)
    # COUNTS' rows in a random (token, slot) order, sorted back by expert as the layer sorts them
    experts = torch.cat([torch.full((c,), e) for e, c in enumerate(COUNTS)])[torch.randperm(sum(COUNTS), generator=g)]
    order = torch.argsort(experts, stable=True).to(_device())
    rows = _rows()
    pos, slot_rows, token_of_row = token_maps(rows, order, top_k)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    assert torch.equal(pos.reshape(-1), inverse) and pos.shape == (tokens, top_k)
    assert torch.equal(slot_rows.reshape(-1), rows.dest[inverse])
    source = rows.source.long()
    expected = torch.where(source >= 0, (order // top_k)[source.clamp(min=0)], -1)
    assert token_of_row.dtype == torch.int32 and torch.equal(token_of_row.long(), expected)
    with pytest.raises(ValueError, match="260 pairs for 261 rows of top-3"):
        token_maps(rows, order[:-1], top_k)


def test_grouped_autograd_function_with_no_rows_at_all():
    from trl_fp8.nn.experts import _GroupedExpertsFP8Matmul

    weight = torch.randn(3, 128, 256, device=_device(), requires_grad=True)
    q, s = kernels.quantize_weight(weight.detach().reshape(384, 256))
    x = torch.zeros(0, 256, device=_device(), requires_grad=True)
    rows = GroupedRows([0, 0, 0], torch.device(_device()))
    y = _GroupedExpertsFP8Matmul.apply(x, weight, q.view(3, 128, 256), s.view(3, 1, 2), rows, "triton", False, True)
    assert y.shape == (0, 128)
    y.sum().backward()
    assert x.grad.shape == (0, 256) and weight.grad.shape == weight.shape and not weight.grad.any()


def test_grouped_gemms_refuse_operands_that_do_not_fit_the_layout():
    rows, act, w = _operands(384, 256, 384)
    q, s = kernels.quantize_weight(w)
    q, s = q.view(5, 256, 384), s.view(5, 2, 3)
    with pytest.raises(ValueError, match="do not fit"):
        m_grouped_gemm(act.q[:128], act.scale_inv[:128], q, s, rows, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        m_grouped_gemm(act.q, act.scale_inv, q, s, rows, torch.float32, block_m=256)
    with pytest.raises(ValueError, match="do not fit"):
        k_grouped_gemm(act.qt, act.scale_inv_t, act.qt[:, :128], act.scale_inv_t[:, :1], rows, torch.float32)


@pytest.mark.parametrize("dtype,pow2", [(torch.float32, False), (torch.bfloat16, True)])
def test_grouped_autograd_function_equals_the_loop_on_the_same_operands(dtype, pow2):
    """One projection, `_GroupedExpertsFP8Matmul` against `_ExpertsFP8Matmul` (the loop on the emulation), from the
    same rows, weight and output gradient: each of y, dx and dW is one GEMM of identical FP8 operands in both, so
    they agree element by element to the kernels' bound (doubled: both round in fp32; plus a bf16 rounding)."""
    from trl_fp8.nn.experts import _ExpertsFP8Matmul, _GroupedExpertsFP8Matmul
    from trl_fp8.quantization import quantize_blocks

    g = torch.Generator().manual_seed(5)
    e, n, k = len(COUNTS), 256, 384
    weight = (torch.randn(e, n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(sum(COUNTS), k, generator=g).to(dtype)
    grad = torch.randn(sum(COUNTS), n, generator=g).to(dtype)
    q, s = quantize_blocks(weight.reshape(e * n, k), power_of_two_scales=pow2)
    q, s = q.view(e, n, k), s.view(e, n // 128, k // 128)
    results = []
    for grouped in (True, False):
        dev = _device() if grouped else "cpu"
        xg, wg = x.to(dev, copy=True).requires_grad_(), weight.to(dev, copy=True).requires_grad_()
        args = (xg, wg, q.to(dev), s.to(dev))
        if grouped:
            y = _GroupedExpertsFP8Matmul.apply(*args, GroupedRows(COUNTS, torch.device(dev)), "triton", pow2, True)
        else:
            y = _ExpertsFP8Matmul.apply(*args, tuple(COUNTS), emulated, pow2, True)
        y.backward(grad.to(dev))
        results.append([t.detach().cpu() for t in (y, xg.grad, wg.grad)])
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = results
    deq = lambda t: dequantize_groups(*quantize_act_layouts(t, power_of_two_scales=pow2)[:2], dtype=F64)[: t.shape[0]]
    w_abs = dequantize_blocks(q.reshape(e * n, k), s.reshape(e * n // 128, k // 128), dtype=F64).abs().view(e, n, k)
    start = 0
    for expert, c in enumerate(COUNTS):
        rows = slice(start, start + c)
        x_abs, dy_abs = deq(x[rows]).abs(), deq(grad[rows]).abs()  # each expert's own 1x128 groups along features
        bf16 = dtype == torch.bfloat16
        _check(y[rows], y_ref[rows].double(), x_abs @ w_abs[expert].t(), k, factor=2.0, ref_in_bf16=bf16)
        _check(dx[rows], dx_ref[rows].double(), dy_abs @ w_abs[expert], n, factor=2.0, ref_in_bf16=bf16)
        if c:  # WGrad's groups run along tokens: the expert's rows padded to 128
            xt = quantize_act_layouts(x[rows], rows=False, cols=True, power_of_two_scales=pow2)
            dyt = quantize_act_layouts(grad[rows], rows=False, cols=True, power_of_two_scales=pow2)
            xt_abs = dequantize_groups(xt.qt, xt.scale_inv_t, dtype=F64).abs()
            dyt_abs = dequantize_groups(dyt.qt, dyt.scale_inv_t, dtype=F64).abs()
            abs_product = dyt_abs @ xt_abs.t()
            _check(dw[expert], dw_ref[expert].double(), abs_product, xt.qt.shape[1], factor=2.0, ref_in_bf16=bf16)
        else:
            assert not dw[expert].any() and not dw_ref[expert].any()
        start += c


def _experts_pair(**routing):
    """The loop (exact reference) and the grouped kernels on the same experts, weights and routing."""
    import copy

    from test_fp8_experts import experts_and_routing

    looped, _, x, index, weights = experts_and_routing(**routing)
    grouped = copy.deepcopy(looped).to(_device())
    grouped._grouped_kernels = True
    return looped, grouped, x, index, weights


def _fwd_bwd(experts, x, index, weights, grad):
    xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts(xg, index, wg)
    out.backward(grad)
    return out, xg.grad, experts.gate_up_proj.grad, experts.down_proj.grad, wg.grad


def test_grouped_experts_equal_the_loop_over_experts(tokens=200):
    """Forward and both gradients of a Qwen3-MoE experts layer (4 experts, top-2, one without tokens, uneven counts):
    the grouped kernels in the interpreter against the per-expert loop on the emulation."""
    looped, grouped, x, index, weights = _experts_pair(tokens=tokens)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    ref = _fwd_bwd(looped, x, index, weights, grad)
    got = _fwd_bwd(grouped, x.to(_device()), index.to(_device()), weights.to(_device()), grad.to(_device()))
    for name, g, r in zip(("out", "dx", "d gate_up_proj", "d down_proj", "d router weights"), got, ref, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert rel_err(g.cpu(), r) < (4e-3 if CUDA else 1e-4), (name, rel_err(g.cpu(), r))
    assert not grouped.gate_up_proj.grad[2].any()  # expert 2 received no token: zero gradient


def test_dgrad_moves_the_cached_blocks_and_computes_what_requantizing_computes(monkeypatch):
    """With the weight cache holding the forward's FP8 experts (the default outside a trainer's memory-tight
    micro-batches), DGrad moves those blocks into its layout instead of re-quantizing the weight: every output and
    gradient is bit for bit the uncached layer's. A forward that records gradients with `cache_with_grad=False`
    holds no cache, and re-quantizes as before."""
    import copy
    import dataclasses

    from trl_fp8.kernels import weight_quant

    _, grouped, x, index, weights = _experts_pair(tokens=60)
    x, index, weights = x.to(_device()), index.to(_device()), weights.to(_device())
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(_device())
    calls = []  # which route each DGrad took
    real_move, real_quant = weight_quant.transpose_expert_weights, weight_quant.quantize_expert_weights_t
    monkeypatch.setattr(weight_quant, "transpose_expert_weights", lambda *a: calls.append("moved") or real_move(*a))
    monkeypatch.setattr(weight_quant, "quantize_expert_weights_t",
                        lambda *a, **k: calls.append("requantized") or real_quant(*a, **k))  # fmt: skip

    def run(**config):
        layer = copy.deepcopy(grouped)
        layer.fp8_config = dataclasses.replace(layer.fp8_config, **config)
        calls.clear()
        return _fwd_bwd(layer, x, index, weights, grad), list(calls)

    cached, calls_cached = run()
    uncached, calls_uncached = run(cache_quantized_weight=False, cache_with_grad=True)
    dropped, calls_dropped = run(cache_with_grad=False)
    assert calls_cached == ["moved"] * 2 and calls_uncached == calls_dropped == ["requantized"] * 2
    for got, ref, also in zip(cached, uncached, dropped, strict=True):
        assert torch.equal(got, ref) and torch.equal(also, ref)


@pytest.mark.parametrize("grouped", [False, True])
def test_gradients_added_in_place_equal_autograds_accumulation(grouped):
    """`fuse_wgrad_accumulation`: over three micro-batches the experts' weight gradients are the ones autograd
    accumulates, bit for bit in fp32 (the kernel adds its fp32 product to the fp32 gradient, as autograd adds the
    returned one); the first micro-batch, whose `.grad` does not exist yet, returns its gradient as before. A weight
    with a gradient hook keeps autograd's accumulation, and its hook runs at every backward."""
    import dataclasses

    from trl_fp8.nn import experts as experts_module

    looped, on_gpu, x, index, weights = _experts_pair(tokens=60)
    layers, device = (on_gpu, _device()) if grouped else (looped, "cpu")
    x, index, weights = x.to(device), index.to(device), weights.to(device)
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(x.shape, generator=g).to(device) for _ in range(3)]

    def accumulate(fused: bool, hook: bool = False):
        import copy

        layer = copy.deepcopy(layers)
        layer.fp8_config = dataclasses.replace(layer.fp8_config, fuse_wgrad_accumulation=fused)
        calls = []
        if hook:
            layer.down_proj.register_post_accumulate_grad_hook(lambda p: calls.append(1))
        added = []
        real = experts_module.gradient_to_add_into
        experts_module.gradient_to_add_into = lambda w: added.append(t := real(w)) or t
        try:
            for grad in grads:
                layer(x, index, weights).backward(grad)
        finally:
            experts_module.gradient_to_add_into = real
        return layer.gate_up_proj.grad.cpu(), layer.down_proj.grad.cpu(), added, calls

    *autograds, none_asked, _ = accumulate(fused=False)
    *fused, added, _ = accumulate(fused=True)
    assert none_asked == [] and [t is not None for t in added] == [False, False, True, True, True, True]
    for got, ref in zip(fused, autograds, strict=True):
        assert torch.equal(got, ref)
    *hooked, added, calls = accumulate(fused=True, hook=True)
    assert len(calls) == 3  # autograd accumulated down_proj's gradient at each backward and ran its hook
    # backward reaches down_proj first, then gate_up_proj: only gate_up's goes in place
    assert [t is not None for t in added] == [False, False, False, True, False, True]
    for got, ref in zip(hooked, autograds, strict=True):
        assert torch.equal(got, ref)


def test_the_trainer_adds_gradients_in_place_in_one_process_only(tmp_path):
    """`FP8GRPOConfig.fp8_linear_config`: on for one process, off under DDP, FSDP and DeepSpeed (their gradient hooks
    would not fire) and for torchao's recipes (no FP8 experts)."""
    from types import SimpleNamespace

    from trl_fp8 import FP8GRPOConfig
    from trl_fp8.plan import WeightCache

    held = WeightCache(True, with_grad=False)
    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert args.fp8_linear_config(held).fuse_wgrad_accumulation
    for launch in ("MULTI_GPU", "FSDP", "DEEPSPEED"):
        args.distributed_state = SimpleNamespace(distributed_type=launch)
        assert not args.fp8_linear_config(held).fuse_wgrad_accumulation, launch
    tensorwise = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, fp8_recipe="tensorwise")
    assert not tensorwise.fp8_linear_config(held).fuse_wgrad_accumulation


def test_grouped_experts_launch_a_fixed_number_of_kernels_whatever_the_expert_count(monkeypatch):
    """fwd + bwd of both projections: one launch for the layout they share, per projection 2 Triton launches
    forward (quantize, FProp) and 4 backward (quantize dy, re-quantize W, DGrad, WGrad), one each way for the
    weighted sum of each token's rows, one summing each token's rows of gate_up's input gradient, and one for the
    maps between tokens and rows, for 4 experts as for 8."""
    if CUDA:
        pytest.skip("counts interpreter launches")
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def counting_run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting_run)
    from test_fp8_experts import tiny_moe

    counts = []
    for num_experts in (4, 8):
        experts = tiny_moe(num_experts=num_experts).model.layers[0].mlp.experts
        from trl_fp8.nn.experts import FP8Experts

        FP8Experts.convert_(experts, FP8LinearConfig(backend="emulated"))
        experts._grouped_kernels = True
        x = torch.randn(64, 256)
        index = torch.randint(0, num_experts, (64, 2))
        launches.clear()
        experts(x.requires_grad_(), index, torch.full((64, 2), 0.5)).sum().backward()
        counts.append(sorted(launches))
    assert counts[0] == counts[1] and len(counts[0]) == 17 and counts[0].count("_layout_kernel") == 1, counts
    assert counts[0].count("_token_maps_kernel") == 1
    assert counts[0].count("_combine_kernel") == 2 and counts[0].count("_combine_backward_kernel") == 1
