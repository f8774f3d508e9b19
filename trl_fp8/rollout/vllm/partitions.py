"""What each rank of a tensor-parallel vLLM engine holds of the trainer's FP8 layers, and the partitions it refuses.

vLLM splits a column-parallel layer (q/k/v, gate/up) along its outputs N and a row-parallel one (o_proj, down_proj)
along its inputs K; key/value heads fewer than the ranks are replicated, not split. Block-FP8 needs every partition to
hold whole 128x128 blocks: vLLM checks it when it builds the layers, deep inside the engine start. Here the same
arithmetic runs before anything starts, so a split that cannot work is refused with the fix, and DeepGEMM's
pre-compilation compiles the partitions' GEMM shapes (`deepgemm_warmup.engine_gemm_shapes`), not the whole layers'.
Experts split the same way (their intermediate size over the ranks); where that falls below whole blocks, vLLM's
expert parallelism gives each rank whole experts instead.
"""

from __future__ import annotations

import os

from torch import nn

from trl_fp8.config import BLOCK
from trl_fp8.nn.adapters import unwrap_model
from trl_fp8.rollout.vllm.engine import expandable_segments_on

__all__ = [
    "ROW_PARALLEL",
    "check_tensor_parallel",
    "multicast_off",
    "partition_shape",
    "tensor_parallel_env",
    "tensor_parallel_overrides",
]

# Layers vLLM splits along their inputs (the rest of a decoder's linear layers split along their outputs).
ROW_PARALLEL = frozenset({"o_proj", "down_proj", "out_proj", "dense_4h_to_h", "fc2", "w2", "wo"})
KV_PROJECTIONS = frozenset({"k_proj", "v_proj"})


def head_dim_of(config) -> int | None:
    """A transformers config's attention head size (`head_dim`, else hidden size over heads), None if it has neither."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    heads = getattr(config, "num_attention_heads", None)
    return int(config.hidden_size // heads) if heads and getattr(config, "hidden_size", None) else None


def partition_shape(leaf: str, n: int, k: int, tp: int, head_dim: int | None = None) -> tuple[int, int]:
    """`(N, K)` of one rank's part of linear layer `leaf` (`[N, K]` weight) in an engine of `tp` ranks. Key/value
    projections keep at least one head per rank (`head_dim` rows), as vLLM replicates heads it cannot split."""
    if tp == 1:
        return n, k
    if leaf in ROW_PARALLEL:
        return n, k // tp
    if leaf in KV_PROJECTIONS and head_dim:
        return max(n // tp, head_dim), k
    return n // tp, k


def _experts_intermediate(module: nn.Module) -> int | None:
    weight = getattr(module, "down_proj", None)
    return int(weight.shape[-1]) if weight is not None and getattr(weight, "dim", lambda: 0)() == 3 else None


def check_tensor_parallel(
    model: nn.Module, fp8_modules: set[str], tp: int, option: str = "vllm_tensor_parallel_size"
) -> dict:
    """Refuse, before the engine starts, a `tp`-rank engine whose partitions of the FP8 layers would not hold whole
    128x128 blocks, naming the layer and the sizes that work. Returns the `LLM(...)` arguments the split needs:
    `enable_expert_parallel=True` when experts would be split below whole blocks (each rank then holds whole
    experts, as vLLM's expert parallelism places them). `option`: the setting's name in the error."""
    if tp <= 1 or not fp8_modules:
        return {}
    hf_model = unwrap_model(model)
    head_dim = head_dim_of(getattr(hf_model, "config", None))
    modules = dict(hf_model.named_modules())
    expert_parallel = False
    for name in sorted(fp8_modules):
        module = modules.get(name)
        if module is None:
            continue
        module = getattr(module, "base_layer", module)
        if (inter := _experts_intermediate(module)) is not None:
            if inter % tp or (inter // tp) % BLOCK:
                expert_parallel = True
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            continue
        leaf = name.rpartition(".")[2]
        n, k = weight.shape
        split = k if leaf in ROW_PARALLEL else n
        part_n, part_k = partition_shape(leaf, n, k, tp, head_dim)
        replicated = leaf in KV_PROJECTIONS and head_dim and n // tp < head_dim
        if not replicated and (split % tp or (part_n % BLOCK) or (part_k % BLOCK)):
            works = [t for t in range(1, 9) if split % t == 0 and (split // t) % BLOCK == 0]
            raise ValueError(
                f"{option}={tp} splits {name} ({'inputs' if leaf in ROW_PARALLEL else 'outputs'} "
                f"{split}) into parts of {split / tp:g}, not a multiple of {BLOCK}: a block-FP8 engine needs whole "
                f"128x128 blocks on every rank. Use {option} in {works} for this layer, keep it in "
                "BF16 (fp8_module_filter_fn), or roll out on a `trl vllm-serve` server with fewer ranks per model."
            )
    return {"enable_expert_parallel": True} if expert_parallel else {}


def multicast_off(environ=os.environ) -> bool:
    """Whether this host's NVLink multicast is switched off (NCCL's NVLS or torch's symmetric-memory multicast)."""
    return environ.get("NCCL_NVLS_ENABLE") == "0" or environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1"


def tensor_parallel_env(tp: int, environ=os.environ) -> dict[str, tuple[str, str]]:
    """Environment a `tp`-rank colocated engine needs on this host, as `{variable: (value, why)}`, assigned before
    vLLM reads it. With NVLink multicast off: vLLM 0.31 builds FlashInfer's all-reduce for every tensor-parallel
    group by default (`VLLM_ALLREDUCE_USE_FLASHINFER=1`; 0.26's default was 0), whose workspace is multicast memory
    first; it is kept off, as 0.26 had it."""
    if tp <= 1 or not multicast_off(environ):
        return {}
    return {
        "VLLM_ALLREDUCE_USE_FLASHINFER": ("0", "NVLink multicast is off here, which FlashInfer's all-reduce needs")
    }


def tensor_parallel_overrides(tp: int, environ=None) -> dict[str, tuple[object, str]]:
    """`LLM(...)` arguments a `tp`-rank colocated engine needs on this host, each with the reason, as
    `{argument: (value, why)}` (`{}` where vLLM's own choices work). `environ`: this process's environment and
    allocator when None; a test's settings otherwise.

    - With NVLink multicast off (`multicast_off`): vLLM 0.26 fuses each all-reduce with the next RMSNorm through
      FlashInfer's TRT-LLM all-reduce, whose workspace is multicast memory, and its first call fails with an illegal
      memory access. The fusion pass is turned off; vLLM's own all-reduce and RMSNorm give the same values.
    - With expandable segments (`expandable_segments_on`: the allocator asked, whichever variable set them):
      vLLM's custom all-reduce shares the buffers of its CUDA graphs between the ranks with `cudaIpcGetMemHandle`,
      which refuses memory from expandable segments, and the engine exits right after capturing its graphs
      (vllm-project/vllm#42609). It is turned off; NCCL all-reduces instead.
    """
    if tp <= 1:
        return {}
    overrides: dict[str, tuple[object, str]] = {}
    if multicast_off(os.environ if environ is None else environ):
        overrides["compilation_config"] = (
            {"pass_config": {"fuse_allreduce_rms": False}},
            "NVLink multicast is off here, which the fused all-reduce + RMSNorm needs",
        )
    if expandable_segments_on(environ):
        overrides["disable_custom_all_reduce"] = (
            True,
            "vLLM's custom all-reduce cannot share CUDA-graph buffers from PyTorch's expandable segments (NCCL instead)",
        )
    return overrides
