"""The rollout engine the way `FP8VLLMGeneration` builds it, for benchmarks that drive vLLM without a trainer:
a config-only folder, `load_format="dummy"`, then the trainer-side model's tensors pushed through layerwise reload.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trl_fp8.export import fp8_module_names
from trl_fp8.vllm_sync import (
    engine_env,
    engine_overrides,
    push_to_engine,
    rollout_weight_tensors,
    write_engine_config,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: its worker is reachable


def start_engine(model, precision: str, workdir: Path, *, fp8_kv_cache: bool = False, **llm_kwargs):
    """An `LLM` for `model` at `precision` ("bf16", "fp8", "fp8_online"), weights not loaded yet (call `sync`)."""
    from vllm import LLM

    os.environ.update(engine_env(precision))  # the kernel that runs our FP8 values as they are
    fp8_modules = fp8_module_names(model) if precision == "fp8" else set()
    engine_dir = write_engine_config(model, None, workdir / f"engine_{precision}", fp8_modules)
    kwargs = dict(
        **engine_overrides(engine_dir, precision, fp8_kv_cache), skip_tokenizer_init=True, dtype="bfloat16",
        seed=0, logprobs_mode="processed_logprobs", enable_prefix_caching=False,
    )  # fmt: skip
    llm = LLM(**{**kwargs, **llm_kwargs})
    llm.trl_fp8_modules = fp8_modules
    return llm


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
