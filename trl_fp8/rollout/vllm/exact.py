"""The vLLM settings under which an engine agrees with itself bit for bit: the engine's half of exact on-policy
training (the trainer's log-probabilities equal to the engine's, KL = 0).

A token's log-probability must not depend on what else the engine ran in the same step (other sequences, a prefill
chunk) nor on whether it was decoded or scored as a prompt; only then can a trainer that calls the same kernels get
the same bits. vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`, in 0.26 and 0.31) fixes the kernels it governs:
no cuBLAS split-K, its own softmax, log-softmax, mean and bmm, a Triton matmul for unquantized linears and the
lm_head, fixed RMSNorm kernels, FlashAttention with one split. The rest are engine settings:

- block-FP8 linears on DeepGEMM with E8M0 off (row-invariant at every M: `tests/gpu/test_exactness_gates_gpu.py`);
- no compilation: Inductor's fusions decide bits no other caller can reproduce (decode CUDA graphs are kept);
- FlashAttention, and no prefix cache (a cached prefix was computed in another launch shape);
- vLLM's V2 model runner, whose sampler computes the log-probabilities the trainer must match.

The mode is process-wide: vLLM overrides aten's softmax, log-softmax, mean and bmm in the process that builds the
engine, which in colocate is the trainer's.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trl_fp8.rollout.vllm.kernels import NO_E8M0

__all__ = [
    "EXACT_ENGINE_ENV",
    "EXACT_LLM_KWARGS",
    "ExactEngine",
    "ExactKernels",
    "batch_invariant_missing",
    "exact_engine",
    "exact_kernels",
]

EXACT_ENGINE_ENV = {
    "VLLM_BATCH_INVARIANT": "1",
    "VLLM_USE_DEEP_GEMM": "1",
    **NO_E8M0,
    "VLLM_USE_V2_MODEL_RUNNER": "1",
}
EXACT_LLM_KWARGS = {
    "attention_backend": "FLASH_ATTN",
    "linear_backend": "deep_gemm",
    # mode 0: no Inductor (its fused kernels are not the ones a trainer calls); CUDA graphs for decode steps only
    "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
    "enable_prefix_caching": False,
}
# Where each tested vLLM keeps its batch-invariant mode (it moved between the two).
BATCH_INVARIANT_FILES = {
    "0.31": "model_executor/determinism/batch_invariant.py",
    "0.26": "model_executor/layers/batch_invariant.py",
}


@dataclass(frozen=True)
class ExactEngine:
    """The environment vLLM must see before it loads, and the `LLM(...)` arguments, of an engine in exact mode."""

    env: dict[str, str] = field(default_factory=lambda: dict(EXACT_ENGINE_ENV))
    llm_kwargs: dict = field(default_factory=lambda: copy.deepcopy(EXACT_LLM_KWARGS))

    def describe(self) -> str:
        """The start-up line: what exact mode changes in the engine and in the process."""
        return (
            "exact mode: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1, process-wide: aten softmax, "
            "log-softmax, mean and bmm are vLLM's in this process), block-FP8 linears on DeepGEMM (E8M0 off), "
            "FlashAttention with one split, no compilation (decode-only CUDA graphs), no prefix cache, the V2 "
            "model runner's sampler"
        )


def _vllm_package_dirs() -> list[Path]:
    """The installed vLLM's package folders, found without importing it (its settings are read at import)."""
    spec = importlib.util.find_spec("vllm")
    return [Path(root) for root in (spec.submodule_search_locations or [])] if spec is not None else []


def batch_invariant_missing() -> str | None:
    """Why the installed vLLM cannot run in batch-invariant mode, or None when it can."""
    roots = _vllm_package_dirs()
    if not roots:
        return "vLLM is not installed (pip install 'trl-fp8[vllm]')"
    if any((root / relative).is_file() for root in roots for relative in BATCH_INVARIANT_FILES.values()):
        return None
    return (
        f"the installed vLLM ({roots[0]}) has no batch-invariant mode (looked for "
        f"{', '.join(BATCH_INVARIANT_FILES.values())}); exact mode is tested on vLLM 0.26 and 0.31"
    )


def exact_engine() -> ExactEngine:
    """The exact-mode engine settings for the installed vLLM; raises, naming the fix, where it has no batch-invariant
    mode."""
    missing = batch_invariant_missing()
    if missing is not None:
        raise RuntimeError(f"Exact mode cannot run: {missing}. Install vLLM 0.31 (pip install 'trl-fp8[vllm]').")
    return ExactEngine()


@dataclass(frozen=True)
class ExactKernels:
    """vLLM's own kernels at the op sites of a dense decoder, called as `trl_fp8.ops.exact`'s ops call theirs."""

    rms_norm: Callable  # (x, weight, eps) and (x, weight, eps, residual=r) -> (normed, x + r), in place
    token_logprobs: Callable  # (logits [N, V], token_ids [N, 1]) -> [N, 1] float32
    silu_and_mul: Callable  # (gate_up [..., 2 * I]) -> [..., I]
    rotary: Callable  # (positions, q, k, head_size, cos_sin_cache, is_neox), in place


def _batch_invariant_module():
    import importlib

    for relative in BATCH_INVARIANT_FILES.values():
        name = "vllm." + relative.removesuffix(".py").replace("/", ".")
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise RuntimeError(f"Exact mode cannot run: {batch_invariant_missing()}")


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    torch.ops._C.silu_and_mul(out, gate_up)  # vLLM's `SiluAndMul.forward_cuda`
    return out


def exact_kernels() -> ExactKernels:
    """The kernels an engine in exact mode runs, from the installed vLLM (imported here: call it once the engine's
    environment is set, `ExactEngine.env`)."""
    from vllm import _custom_ops
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    return ExactKernels(
        rms_norm=_batch_invariant_module().rms_norm_batch_invariant,
        token_logprobs=compute_token_logprobs,
        silu_and_mul=_silu_and_mul,
        rotary=_custom_ops.rotary_embedding,
    )
