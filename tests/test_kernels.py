"""The Triton quantization kernels (`trl_fp8.kernels`) against the reference quantizers, bit for bit.

On CPU they run in Triton's interpreter (conftest sets `TRITON_INTERPRET=1`), which checks every index, mask, layout
and scale step of the kernel code itself. The interpreter's own float32 -> e4m3 and float32 -> bf16 conversions are
wrong (they truncate the mantissa without carrying into the exponent), so here they are replaced by torch's
round-to-nearest-even casts, which is what the GPU's `cvt.rn.satfinite.e4m3x2.f32` and `cvt.rn.bf16.f32` do;
tests/gpu runs the same kernels compiled on Hopper.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trl_fp8.quantization import quantize_act_layouts, quantize_blocks, quantize_groups

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from trl_fp8 import kernels  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")  # conftest: exact fp32 -> e4m3 / bf16 casts


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _input(m, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[:, :128] *= 1e-3  # a range of magnitudes across groups
    x[: min(m, 128), -128:] = 0  # an all-zero group and tile: amax floor
    x.view(-1)[7] = -448 * 4  # saturation territory for its group's neighbours
    return x.to(dtype).to(_device())


@pytest.mark.parametrize("m,k", [(256, 384), (200, 256), (1, 128), (130, 128)])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("second_read", [False, True])
def test_act_quant_both_layouts_match_reference(m, k, pow2, second_read):
    x = _input(m, k)
    got = kernels.quantize_act(x, rows=True, cols=True, power_of_two_scales=pow2, cols_second_read=second_read)
    ref = quantize_act_layouts(x, rows=True, cols=True, power_of_two_scales=pow2)
    m_pad = -(-m // 128) * 128
    assert got.q.shape == (m_pad, k) and got.qt.shape == (k, m_pad)
    assert torch.equal(_bits(got.q), _bits(ref.q)) and torch.equal(got.scale_inv, ref.scale_inv)
    assert torch.equal(_bits(got.qt), _bits(ref.qt)) and torch.equal(got.scale_inv_t, ref.scale_inv_t)
    # cuBLAS layouts: row-major operands, column-major scales
    assert got.q.is_contiguous() and got.qt.is_contiguous()
    assert got.scale_inv.stride(0) == 1 and got.scale_inv_t.stride(0) == 1
    # the reference itself is the plain groupwise quantizer on zero-padded tokens
    xp = F.pad(x, (0, 0, 0, m_pad - m))
    assert torch.equal(_bits(ref.qt), _bits(quantize_groups(xp.t().contiguous(), power_of_two_scales=pow2)[0]))


@pytest.mark.parametrize("rows,cols,second_read", [(True, False, False), (False, True, False), (False, True, True)])
def test_act_quant_one_layout_and_strided_input(rows, cols, second_read):
    base = _input(300, 512, dtype=torch.float32)
    x = base[:, 128:384]  # a strided view: read in place, no copy
    got = kernels.quantize_act(x, rows=rows, cols=cols, cols_second_read=second_read)
    ref = quantize_act_layouts(x.contiguous(), rows=rows, cols=cols)
    if rows:
        assert got.qt is None and torch.equal(_bits(got.q), _bits(ref.q)) and torch.equal(got.scale_inv, ref.scale_inv)
    else:
        assert got.q is None and torch.equal(_bits(got.qt), _bits(ref.qt))
        assert torch.equal(got.scale_inv_t, ref.scale_inv_t)


@pytest.mark.parametrize("m", [256, 200, 1])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("rows,cols", [(True, True), (True, False), (False, True)])
def test_swiglu_quant_matches_reference(m, pow2, rows, cols):
    """gate and up as the two column halves of one gate_up output (what grouped siblings hand over), BF16.

    The product is eager's up to the exponential: this kernel's `exp` (here NumPy's, on the GPU Triton's) and
    PyTorch's `silu` may round the last bit differently, which BF16 rounding hides but for rare ties. So the product
    the kernel formed (written to `out` for this test) must be eager's but for at most 0.5% of its elements, each
    one BF16 step away, and the FP8 operands must be the reference quantization of that product, bit for bit."""
    gate_up = torch.cat([_input(m, 256, seed=1), _input(m, 256, seed=2)], dim=1)
    gate, up = gate_up[:, :256], gate_up[:, 256:]
    h = torch.empty(m, 256, dtype=gate.dtype, device=gate.device)
    got = kernels.quantize_swiglu(gate, up, rows=rows, cols=cols, power_of_two_scales=pow2, out=h)
    eager = F.silu(gate) * up
    differ = h != eager
    assert differ.float().mean().item() <= 0.005
    step = (eager.float().abs() * 2**-7).clamp(min=2**-133)  # one BF16 step at each value (8 significant bits)
    assert ((h.float() - eager.float()).abs()[differ] <= step[differ] * 1.001).all()
    ref = quantize_act_layouts(h, rows=rows, cols=cols, power_of_two_scales=pow2)
    if rows:
        assert torch.equal(_bits(got.q), _bits(ref.q)) and torch.equal(got.scale_inv, ref.scale_inv)
        assert got.q.is_contiguous() and got.scale_inv.stride(0) == 1
    if cols:
        assert torch.equal(_bits(got.qt), _bits(ref.qt)) and torch.equal(got.scale_inv_t, ref.scale_inv_t)
        assert got.qt.is_contiguous() and got.scale_inv_t.stride(0) == 1
    assert (got.q is None) != rows and (got.qt is None) != cols


def test_swiglu_quant_refuses_mismatched_operands():
    x = _input(128, 256)
    with pytest.raises(ValueError, match="one shape and dtype with unit stride"):
        kernels.quantize_swiglu(x, x[:, :128])
    with pytest.raises(ValueError, match="one shape and dtype with unit stride"):
        kernels.quantize_swiglu(x.t(), x.t())


@pytest.mark.parametrize("n,k", [(256, 384), (200, 130), (128, 640)])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("col_major", [False, True])
def test_weight_quant_matches_reference(n, k, pow2, col_major):
    w = _input(n, k, seed=1)
    q, s = kernels.quantize_weight(w, col_major=col_major, power_of_two_scales=pow2)
    q_ref, s_ref = quantize_blocks(w, power_of_two_scales=pow2)
    assert q.shape == (n, k) and s.shape == s_ref.shape
    assert (q.stride(0) == 1) == col_major and (s.stride(0) == 1) == col_major or s.shape[0] == 1
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s.contiguous(), s_ref)


def test_power_of_two_scales_round_down_exactly():
    """Scales just under a power of two round down to the power below, never up (the reference clears mantissa
    bits instead of taking a float32 log2, which rounds 2**k * (1 - 2**-24) up to k)."""
    just_under = torch.tensor(1024.0).nextafter(torch.tensor(0.0))  # 1024 * (1 - 2**-24)
    amax = (448.0 / just_under.double()).float()
    x = torch.zeros(1, 128)
    x[0, 0] = amax
    _, s = quantize_groups(x, power_of_two_scales=True)
    scale = 1 / s.item()
    assert scale <= (448.0 / amax.double()).item() and scale == 2.0 ** round(np.log2(scale))
    got = kernels.quantize_act(x.to(_device()), power_of_two_scales=True)
    assert torch.equal(got.scale_inv[:1].cpu(), s)
