"""Scale arithmetic shared by the quantization kernels, step for step as `trl_fp8.quantization._scale_from_amax`
(448 is e4m3's largest finite value, 1e-12 the amax floor of all-zero groups)."""

import triton
import triton.language as tl


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
