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

vLLM 0.31 is exact so (`tests/gpu/test_exactness_gates_gpu.py`); vLLM 0.26 is not, and exact mode refuses it
(`NOT_EXACT`).

The mode is process-wide: vLLM overrides aten's softmax, log-softmax, mean and bmm in the process that builds the
engine, which in colocate is the trainer's.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trl_fp8.ops.exact import ExactKernels
from trl_fp8.rollout.vllm._compat import vllm_package_dirs
from trl_fp8.rollout.vllm.kernels import NO_E8M0
from trl_fp8.stack import installed_versions, release

__all__ = [
    "EXACT_ENGINE_ENV",
    "EXACT_LLM_KWARGS",
    "ExactEngine",
    "batch_invariant_missing",
    "exact_engine",
    "exact_kernels",
    "release_not_exact",
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
# vLLM releases whose batch-invariant mode is not invariant where exact mode needs it, and why (measured on one H200,
# 2026-12-03: their decode gives other bits than their prefill of the same tokens).
NOT_EXACT = {
    "0.26": (
        "its batch-invariant mode keeps the residual add + RMSNorm on a CUDA kernel whose block width follows the "
        "launch's row count (1,024 threads under 256 rows, 256 from there), so a decode step and a prefill round the "
        "same row differently and 512-token completions part by up to 0.1 in log-probability (fixed in vLLM 0.31 by "
        "its pull request 48391)"
    ),
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


def batch_invariant_missing() -> str | None:
    """Why the installed vLLM cannot run in batch-invariant mode, or None when it can."""
    roots = vllm_package_dirs()
    if not roots:
        return "vLLM is not installed (pip install 'trl-fp8[vllm]')"
    if any((root / relative).is_file() for root in roots for relative in BATCH_INVARIANT_FILES.values()):
        return None
    return (
        f"the installed vLLM ({roots[0]}) has no batch-invariant mode (looked for "
        f"{', '.join(BATCH_INVARIANT_FILES.values())}); exact mode runs on vLLM 0.31"
    )


def release_not_exact(vllm_version: str | None = None) -> str | None:
    """Why the installed vLLM (or `vllm_version`) cannot be exact in its batch-invariant mode, or None."""
    if vllm_version is None:
        vllm_version = installed_versions(("vllm",)).get("vllm")
    reason = NOT_EXACT.get(release(vllm_version)) if vllm_version else None
    return f"vLLM {vllm_version} is not exact: {reason}" if reason else None


def exact_engine() -> ExactEngine:
    """The exact-mode engine settings for the installed vLLM; raises, naming the fix, where it has no batch-invariant
    mode or one that is not exact (`NOT_EXACT`)."""
    missing = batch_invariant_missing() or release_not_exact()
    if missing is not None:
        raise RuntimeError(f"Exact mode cannot run: {missing}. Install vLLM 0.31 (pip install 'trl-fp8[vllm]').")
    return ExactEngine()


def _batch_invariant_module():
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


def _fp8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale_inv: torch.Tensor, out_dtype) -> torch.Tensor:
    """vLLM's block-FP8 linear on DeepGEMM (`DeepGemmFp8BlockScaledMMKernel.apply_weights`): its 1x128 quantizer
    (`QuantFP8`, column-major scales, E8M0 off), the weight scales in DeepGEMM's layout, `fp8_gemm_nt`."""
    import vllm.envs as envs
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        deepgemm_post_process_fp8_weight_block,
        per_token_group_quant_fp8,
    )
    from vllm.utils.deep_gemm import fp8_gemm_nt

    q, scale = per_token_group_quant_fp8(
        x, 128, dtype=torch.float8_e4m3fn, column_major_scales=True,
        tma_aligned_scales=envs.VLLM_USE_DEEP_GEMM_TMA_ALIGNED_SCALES, use_ue8m0=False,
    )  # fmt: skip
    weight_q, weight_scale = deepgemm_post_process_fp8_weight_block(
        weight_q.contiguous(), weight_scale_inv.float().contiguous(), (128, 128), use_e8m0=False
    )
    # (the scales' layout is redone at each call: a small tensor, kept simple until exact mode's cost is measured)
    out = torch.empty(x.shape[0], weight_q.shape[0], dtype=out_dtype, device=x.device)
    fp8_gemm_nt((q, scale), (weight_q, weight_scale), out, is_deep_gemm_e8m0_used=False)
    return out


PAGE = 16  # vLLM's KV-cache page for FlashAttention


def _attention(q, k, v, cu_seqlens, max_seqlen, softmax_scale, scales=None, *, query_quant=None):
    """vLLM's FlashAttention-3 as its batch-invariant mode runs it (one split, causal) over a paged copy of the
    packed keys and values (pages of 16, as the engine's cache): the prefill of each sequence, whose rows equal
    the engine's decode of them (`tests/gpu/test_exactness_gates_gpu.py`).

    With an FP8 KV cache (`scales`: the layer's q, k and v scales as the engine holds them), the copy is written by
    the engine's cache kernel (`reshape_and_cache_flash`, "fp8": `x / scale` rounded to float8_e4m3fn), the query
    quantized by the engine's own `query_quant` (None: the engine attends with a BF16 query), and FlashAttention
    descales each operand as `FlashAttentionImpl.forward` asks it to."""
    from vllm import _custom_ops
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pages = (lengths + PAGE - 1) // PAGE
    first_page = torch.cumsum(pages, 0) - pages
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)
    position = torch.arange(q.shape[0], device=q.device) - cu_seqlens[:-1].long()[seq]
    slot = (first_page[seq] + position // PAGE) * PAGE + position % PAGE
    shape = (int(pages.sum()) * PAGE, *k.shape[1:])
    descales = {}
    if scales is None:
        k_cache, v_cache = k.new_zeros(shape), v.new_zeros(shape)
        k_cache[slot], v_cache[slot] = k, v
    else:
        q_scale, k_scale, v_scale = scales
        paged = (-1, PAGE, *k.shape[1:])
        k_cache, v_cache = (torch.zeros(shape, dtype=torch.uint8, device=k.device).view(paged) for _ in range(2))
        _custom_ops.reshape_and_cache_flash(k, v, k_cache, v_cache, slot, "fp8", k_scale, v_scale)
        k_cache, v_cache = (c.view(torch.float8_e4m3fn) for c in (k_cache, v_cache))
        descale_shape = (len(lengths), k.shape[1])  # (sequences, KV heads), as the engine expands them
        descales = {"k_descale": k_scale.expand(descale_shape), "v_descale": v_scale.expand(descale_shape)}
        if query_quant is not None:
            q8, _ = query_quant(q.reshape(q.shape[0], -1), q_scale)  # as the engine's Attention.forward calls it
            q = q8.view(q.shape)
            descales["q_descale"] = q_scale.expand(descale_shape)
    width = int(pages.max())
    block_table = (first_page[:, None] + torch.arange(width, device=q.device)).clamp(max=int(pages.sum()) - 1)
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device)  # BF16 out of FP8 operands too
    flash_attn_varlen_func(
        q=q, k=k_cache.view(-1, PAGE, *k.shape[1:]), v=v_cache.view(-1, PAGE, *v.shape[1:]), cu_seqlens_q=cu_seqlens,
        max_seqlen_q=max_seqlen, seqused_k=lengths.int(), max_seqlen_k=width * PAGE, softmax_scale=softmax_scale,
        causal=True, window_size=[-1, -1], block_table=block_table.int(), softcap=0, fa_version=3, num_splits=1,
        out=out, **descales,
    )  # fmt: skip
    return out


def exact_kernels(query_quant: Callable | None = None) -> ExactKernels:
    """The kernels an engine in exact mode runs, from the installed vLLM (imported here: call it once the engine's
    environment is set, `ExactEngine.env`). `query_quant`: the engine's quantizer of FP8 queries
    (`_compat.engine_query_quant`), for an FP8 KV cache."""
    from vllm import _custom_ops
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    batch_invariant = _batch_invariant_module()
    return ExactKernels(
        rms_norm=batch_invariant.rms_norm_batch_invariant,
        add_rms_norm=batch_invariant.rms_norm_batch_invariant,
        rotary=_custom_ops.rotary_embedding,
        attention=functools.partial(_attention, query_quant=query_quant),
        fp8_linear=_fp8_linear,
        linear=batch_invariant.linear_batch_invariant,
        silu_and_mul=_silu_and_mul,
        token_logprobs=compute_token_logprobs,
    )
