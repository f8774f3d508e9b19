"""Property tests of the blockwise / groupwise FP8 quantizers against the e4m3 rounding bound."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_fp8 import FP8_DTYPE, FP8_MAX, dequantize_blocks, dequantize_groups, quantize_blocks, quantize_groups


def e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |v| (v in the scaled, FP8 domain): 2**(e-3)/2 for normals, 2**-10 below 2**-6."""
    a = v.abs().double().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3) / 2


def assert_within_half_ulp(x, q, scale_inv_full):
    """|dequant - x| <= half an e4m3 ulp of the scaled value, back in x's units, plus the fp32 rounding of x * scale
    (a few fp32 ulps of |x|, which can tip a value just past a rounding midpoint)."""
    x = x.double()
    scaled = x / scale_inv_full.double()
    bound = e4m3_half_ulp(scaled) * scale_inv_full.double() + x.abs() * 2.0**-21
    err = (q.double() * scale_inv_full.double() - x).abs()
    assert torch.isfinite(err).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


shapes = st.tuples(st.integers(1, 300), st.integers(1, 300))
magnitudes = st.floats(min_value=-30, max_value=30)  # log2 of the data's scale


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    log_mag=magnitudes,
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_quantize_blocks_error_bound(shape, log_mag, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 2.0**log_mag).to(dtype)
    q, s = quantize_blocks(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not torch.isnan(q.float()).any()
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    assert_within_half_ulp(w.float(), q, full)
    # scale_inv is amax / 448 (to fp32 rounding) for blocks that are not all zero
    amax = torch.nn.functional.pad(w.float().abs(), (0, -shape[1] % 128, 0, -shape[0] % 128))
    amax = amax.reshape(s.shape[0], 128, s.shape[1], 128).amax(dim=(1, 3))
    nz = amax > 0
    torch.testing.assert_close(s[nz], amax[nz] / FP8_MAX, rtol=2e-7, atol=0)
    torch.testing.assert_close(dequantize_blocks(q, s), q.float() * full, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 64), groups=st.integers(1, 4), log_mag=magnitudes, seed=st.integers(0, 2**16))
def test_quantize_groups_error_bound(rows, groups, log_mag, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * 128, generator=g) * 2.0**log_mag
    q, s = quantize_groups(x)
    assert q.shape == x.shape and q.dtype == FP8_DTYPE and s.shape == (rows, groups) and s.dtype == torch.float32
    full = s.repeat_interleave(128, 1)
    assert_within_half_ulp(x, q, full)
    torch.testing.assert_close(dequantize_groups(q, s), q.float() * full, rtol=0, atol=0)
    # each group's largest element maps to +-448 exactly
    assert (q.float().abs().reshape(rows, groups, 128).amax(-1) == FP8_MAX).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), log_scale=st.integers(-20, 20))
def test_representable_values_round_trip_exactly(seed, log_scale):
    """FP8 values times a power-of-two block scale, with +-448 in every block, come back bit for bit."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (256, 384), generator=g, dtype=torch.uint8)
    q0 = bits.view(FP8_DTYPE).float()
    q0 = torch.where(torch.isfinite(q0), q0, torch.zeros_like(q0))  # drop the NaN encodings
    q0[:, ::128] = FP8_MAX  # every block and every 1x128 group has amax 448
    x = q0 * 2.0**log_scale
    q, s = quantize_blocks(x)
    assert torch.equal(q.float(), q0)
    assert (s == 2.0**log_scale).all()
    assert torch.equal(dequantize_blocks(q, s), x)
    qg, sg = quantize_groups(x[:, :128].contiguous())
    assert torch.equal(dequantize_groups(qg, sg), x[:, :128])


@pytest.mark.parametrize("fn", [quantize_blocks, quantize_groups])
def test_zero_tiny_and_huge_blocks_stay_finite(fn):
    x = torch.zeros(256, 256)
    x[128:, :128] = 1e-30
    x[:128, 128:] = torch.finfo(torch.bfloat16).max
    x[128:, 128:] = -3e38
    q, s = fn(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not torch.isnan(q.float()).any()
    assert (q[:128, :128].float() == 0).all()  # all-zero block -> zeros with a finite scale


@settings(max_examples=30, deadline=None)
@given(shape=shapes, log_mag=magnitudes, seed=st.integers(0, 2**16))
def test_power_of_two_scales(shape, log_mag, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 2.0**log_mag
    q, s = quantize_blocks(w, power_of_two_scales=True)
    assert torch.equal(torch.exp2(torch.round(torch.log2(s))), s)  # every scale is a power of two
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    assert_within_half_ulp(w, q, full)
    # rounding the scale down never saturates: the scaled block max stays <= 448 and >= 224
    blk_max = torch.nn.functional.pad(q.float().abs(), (0, -shape[1] % 128, 0, -shape[0] % 128))
    blk_max = blk_max.reshape(s.shape[0], 128, s.shape[1], 128).amax(dim=(1, 3))
    assert (blk_max <= FP8_MAX).all() and (blk_max >= FP8_MAX / 2 - 16).all()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="2-D"):
        quantize_blocks(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_groups(torch.randn(4, 100))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_blocks(torch.zeros(256, 256, dtype=FP8_DTYPE), torch.ones(1, 1))
