"""The set of kernels exact mode's ops run: the engine's (`rollout.vllm.exact.exact_kernels`) or, where it has none
(CPU, tests), the references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trl_fp8.ops.exact.attention import reference_attention
from trl_fp8.ops.exact.linear import reference_linear
from trl_fp8.ops.exact.rms_norm import reference_add_rms_norm, reference_rms_norm
from trl_fp8.ops.exact.rotary import reference_rotary
from trl_fp8.ops.exact.silu_and_mul import reference_silu_and_mul
from trl_fp8.ops.exact.token_logprobs import reference_token_logprobs


@dataclass(frozen=True)
class ExactKernels:
    """One kernel per op site of a dense decoder, each called as its op in `trl_fp8.ops.exact` says.
    `fp8_linear` None: each `FP8Linear`'s own FProp (`reference_fp8_linear` on the layer's backend)."""

    rms_norm: Callable = reference_rms_norm
    add_rms_norm: Callable = reference_add_rms_norm
    rotary: Callable = reference_rotary
    attention: Callable = reference_attention
    fp8_linear: Callable | None = None
    linear: Callable = reference_linear
    silu_and_mul: Callable = reference_silu_and_mul
    token_logprobs: Callable = reference_token_logprobs


REFERENCE_KERNELS = ExactKernels()
