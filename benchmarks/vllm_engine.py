"""The rollout engine the way `FP8VLLMGeneration` builds it, for benchmarks that drive vLLM without a trainer:
a config-only folder, `load_format="dummy"`, then the trainer-side model's tensors pushed through layerwise reload.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trl_fp8.checkpoint.save import fp8_module_names
from trl_fp8.rollout.vllm.deepgemm_warmup import precompile_engine_kernels
from trl_fp8.rollout.vllm.engine import (
    TRL_MAX_NUM_BATCHED_TOKENS,
    apply_engine_env,
    engine_overrides,
    push_to_engine,
    rollout_weight_tensors,
    write_engine_config,
)
from trl_fp8.rollout.vllm.kernels import rollout_kernel

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: its worker is reachable


def start_engine(
    model,
    precision: str,
    workdir: Path,
    *,
    fp8_kv_cache: bool = False,
    backend: str = "auto",
    deepgemm_workers: int | None = None,
    **llm_kwargs,
):
    """An `LLM` for `model` at `precision` ("bf16", "fp8", "fp8_online"), weights not loaded yet (call `sync`);
    FP8 layers on the `backend` kernel (`trl_fp8.rollout.vllm.kernels.rollout_kernel`), its DeepGEMM kernels compiled by
    `deepgemm_workers` processes first (`trl_fp8.rollout.vllm.deepgemm_warmup`; 0: vLLM's warm-up alone)."""
    from vllm import LLM

    kernel = rollout_kernel(backend) if precision == "fp8" else None
    apply_engine_env(precision, kernel)  # the kernel that runs our FP8 values as they are
    fp8_modules = fp8_module_names(model) if precision == "fp8" else set()
    engine_dir = write_engine_config(model, None, workdir / f"engine_{precision}", fp8_modules)
    max_tokens = llm_kwargs.get("max_num_batched_tokens", TRL_MAX_NUM_BATCHED_TOKENS)
    precompiled = precompile_engine_kernels(kernel, model, fp8_modules, max_tokens, workers=deepgemm_workers)
    kwargs = dict(
        **engine_overrides(engine_dir, precision, fp8_kv_cache, kernel), skip_tokenizer_init=True, dtype="bfloat16",
        seed=0, logprobs_mode="processed_logprobs", enable_prefix_caching=False,
    )  # fmt: skip
    llm = LLM(**{**kwargs, **llm_kwargs})
    llm.trl_fp8_modules = fp8_modules
    llm.trl_fp8_precompile = precompiled
    return llm


def engine_kernels(llm) -> dict:
    """What vLLM actually selected: the FP8 linear kernel class (or the layer's quant method), the attention
    implementation, and the KV cache's dtype and capacity in tokens (0 when vLLM did not report it). Best effort:
    a field vLLM does not expose reads "unknown" instead of failing a long benchmark run."""

    def read(fn, default="unknown"):
        try:
            return fn()
        except (AttributeError, IndexError, TypeError):
            return default

    model = read(lambda: llm.llm_engine.model_executor.driver_worker.worker.model_runner.model, None)
    layer = read(lambda: model.model.layers[0], None)
    method = read(lambda: layer.mlp.gate_up_proj.quant_method, None) or read(
        lambda: layer.self_attn.qkv_proj.quant_method, None
    )  # a mixture of experts has no dense MLP
    experts = next((m for n, m in read(lambda: layer.named_modules(), []) if hasattr(m, "w13_weight")), None)
    cache = read(lambda: llm.llm_engine.vllm_config.cache_config, None)
    return {
        "linear_kernel": type(getattr(method, "fp8_linear", method)).__name__,
        **(
            {
                "experts_method": f"{type(read(lambda: experts.quant_method, None)).__name__} "
                f"({read(lambda: experts.quant_method.fp8_backend.value)})"
            }
            if experts is not None
            else {}
        ),
        "attention_backend": read(lambda: type(layer.self_attn.attn.impl).__name__),
        "kv_cache_dtype": read(lambda: str(cache.cache_dtype)),
        "kv_cache_tokens": read(lambda: int(cache.num_gpu_blocks * cache.block_size), 0),
    }


def sync(llm, model, precision: str, attention_scales=None) -> float:
    """Push `model`'s rollout tensors into the running engine; returns seconds (quantization included)."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    pairs = rollout_weight_tensors(
        model, precision, fp8_modules=llm.trl_fp8_modules, attention_scales=attention_scales
    )
    push_to_engine(llm, pairs)
    torch.cuda.synchronize()
    return time.perf_counter() - start
