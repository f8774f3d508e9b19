"""Every access to vLLM internals that no public API offers, in one place (tested against vLLM 0.26).

When a vLLM release moves one of these, this file is what changes; each function says what it reaches and why no
public path does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# The logger of vLLM's layerwise reload, which warns for each layer that gets no tensor in a sync.
LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def engine_worker(llm):
    """The worker of an in-process `vllm.LLM` (colocated, one rank): its `reload_weights` is the only refresh path
    that works on a running FP8 engine (`model.load_weights` fails once FP8 layers have been processed)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def engine_model(llm) -> nn.Module:
    """The model inside an in-process `vllm.LLM`: the in-place expert write and the identity checks read it."""
    return engine_worker(llm).model_runner.model


def engine_stat_logger_manager(llm):
    """The engine's stat-logger manager (None if it has none): rollout statistics replace its loggers."""
    return getattr(getattr(llm, "llm_engine", None), "logger_manager", None)


def engine_cache_config(llm):
    """The cache config vLLM settled on at start-up (`num_gpu_blocks` x `block_size` KV tokens)."""
    return llm.llm_engine.vllm_config.cache_config


def moe_kernel_format_converter() -> Callable:
    """vLLM's own conversion of stacked FP8 experts into its MoE kernel's layout (what its post-load runs)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import convert_to_fp8_moe_kernel_format

    return convert_to_fp8_moe_kernel_format


def deepgemm_warmup_token_counts(max_tokens: int, n: int, device: torch.device) -> list[int]:
    """The token counts vLLM's DeepGEMM warm-up runs for a layer of `n` outputs (its 'relax' mode)."""
    from vllm.model_executor.warmup.deep_gemm_warmup import _generate_optimal_warmup_m_values

    return _generate_optimal_warmup_m_values(max_tokens, n, device)


# vLLM's fused SiLU-and-mul + 1x128-group FP8 quantization op (`csrc/quantization/fused_kernels/`), which its compile
# pass `fuse_act_quant` and its Triton fused MoE call; `rollout.vllm.act_quant` re-registers its CUDA kernel.
SILU_MUL_QUANT_OP = ("_C", "silu_and_mul_per_block_quant")
# Its schema in vLLM 0.26 (`csrc/torch_bindings.cpp`; the GPU suite checks the loaded op's arguments against it). The
# CPU tests define an op with it, to call our kernel the way the dispatcher calls vLLM's.
SILU_MUL_QUANT_SCHEMA = (
    "(Tensor! out, Tensor input, Tensor! scales, int group_size, Tensor? scale_ub=None, "
    "bool is_scale_transposed=False) -> ()"
)


def silu_mul_quant_op():
    """The op's overload (`torch.ops._C.silu_and_mul_per_block_quant.default`), or None where vLLM's compiled ops
    are not here. No public API replaces an op's kernel; `torch.library` does it from its namespace and name."""
    try:
        import vllm._custom_ops  # noqa: F401 (loads vllm._C, which registers the op)
    except ImportError:
        return None
    namespace, name = SILU_MUL_QUANT_OP
    packet = getattr(getattr(torch.ops, namespace), name, None)
    return None if packet is None else packet.default
