"""A vLLM plugin for GPU-suite processes that share a GPU (`run_suite.py --lanes-per-gpu 2`): each engine's KV cache
gets a fixed size (`TRL_FP8_TEST_KV_CACHE_BYTES`) in place of the one vLLM measures as it starts.

vLLM sizes the cache from the GPU's free memory before and after a profile run of the model, and stops when another
process freed memory in between ("Error in memory profiling") or finds no room when one took some ("No available memory
for the cache blocks"). Two lanes on one GPU do that to each other whenever one's engine starts while the other's
starts, sleeps or shuts down. With `kv_cache_memory_bytes` set, vLLM skips that measurement (its GPU worker's
`determine_available_memory`) and still runs the profile pass that compiles the model. vLLM calls `fix_kv_cache_size` in
each of its processes (`vllm.general_plugins`, an entry point the runner writes beside a copy of this file) before it
builds an engine's configuration from its arguments, which is where the size goes in; an engine given a size of its own
keeps it. Without the variable it does nothing, so one process per GPU keeps vLLM's own sizing from
`gpu_memory_utilization`.
"""

from __future__ import annotations

import os

KV_CACHE_BYTES_ENV = "TRL_FP8_TEST_KV_CACHE_BYTES"


def fix_kv_cache_size() -> None:
    """vLLM's entry point: give every engine this process configures the KV cache size the runner set."""
    size = os.environ.get(KV_CACHE_BYTES_ENV)
    if not size:
        return
    from vllm.engine.arg_utils import EngineArgs  # loaded already: vLLM loads its plugins from EngineArgs itself

    patch_engine_args(EngineArgs, int(size))


def patch_engine_args(engine_args: type, size: int) -> None:
    """`engine_args.create_engine_config` (vLLM's `EngineArgs`, which every `LLM(...)` and server builds its
    configuration with) sets `kv_cache_memory_bytes` to `size` where the engine set none. A second patch (a process
    may call the plugin by two routes) wraps nothing more."""
    configure = engine_args.create_engine_config
    if getattr(configure, "fixed_kv_cache_bytes", None) is not None:
        return

    def create_engine_config(self, *args, **kwargs):
        if self.kv_cache_memory_bytes is None:
            self.kv_cache_memory_bytes = size
        return configure(self, *args, **kwargs)

    create_engine_config.fixed_kv_cache_bytes = size
    engine_args.create_engine_config = create_engine_config
