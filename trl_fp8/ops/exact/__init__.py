"""The trainer's forward ops of exact mode: each op's forward is the very kernel the rollout engine runs (handed in by
the caller: vLLM's, from `rollout.vllm.exact`), so the trainer's values equal the engine's bit for bit; its backward
is a float32 formula of the op's gradient, which need not be bitwise anything (only forward values enter the
importance ratio).

One op per file, each with `reference_<op>`: the op's math in PyTorch, the stand-in kernel on machines without
vLLM's and the reference the tests hold each backward to.
"""

from trl_fp8.ops.exact.attention import attention, reference_attention
from trl_fp8.ops.exact.fp8_linear import fp8_linear, reference_fp8_linear
from trl_fp8.ops.exact.kernels import REFERENCE_KERNELS, ExactKernels
from trl_fp8.ops.exact.linear import linear, reference_linear
from trl_fp8.ops.exact.rms_norm import add_rms_norm, reference_add_rms_norm, reference_rms_norm, rms_norm
from trl_fp8.ops.exact.rotary import reference_rotary, rotary
from trl_fp8.ops.exact.silu_and_mul import reference_silu_and_mul, silu_and_mul
from trl_fp8.ops.exact.token_logprobs import reference_token_logprobs, token_logprobs

__all__ = [
    "REFERENCE_KERNELS",
    "ExactKernels",
    "add_rms_norm",
    "attention",
    "fp8_linear",
    "linear",
    "reference_attention",
    "reference_fp8_linear",
    "reference_linear",
    "reference_add_rms_norm",
    "reference_rms_norm",
    "reference_rotary",
    "reference_silu_and_mul",
    "reference_token_logprobs",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "token_logprobs",
]
