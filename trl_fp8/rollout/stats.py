"""What a colocated vLLM engine did during a rollout (peak running sequences, preemptions, peak KV-cache use), and
the one-line account of its KV capacity, so a user sees why FP8 rollouts are faster where they are.

vLLM computes these statistics itself when its engine is built with `disable_log_stats=False`, and hands them to
its stat loggers after every engine step. `RolloutStats` takes the place of those loggers (vLLM's own print a line
every 10 s and fill a Prometheus registry, neither wanted inside a trainer) and keeps the maxima and sums between
two reads.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["RolloutStats", "capacity_line", "engine_kv_cache_tokens"]


class RolloutStats:
    """vLLM's stat-logger interface (`record`, `log`, `log_engine_initialized`, `record_sleep_state`), keeping per
    rollout: the most sequences running at once, how many were preempted (their KV cache evicted and recomputed:
    the engine held too few tokens), the most waiting, and the peak KV-cache use."""

    def __init__(self):
        self.read()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
        if scheduler_stats is not None:
            self.running_peak = max(self.running_peak, scheduler_stats.num_running_reqs)
            self.waiting_peak = max(self.waiting_peak, scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage_peak = max(self.kv_cache_usage_peak, scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def read(self, reset: bool = True) -> dict[str, float]:
        """The statistics since the last reset (and start again, unless `reset=False`)."""
        values = {
            name: float(getattr(self, name, 0))
            for name in ("running_peak", "waiting_peak", "preemptions", "kv_cache_usage_peak")
        }
        if reset:
            self.running_peak = self.waiting_peak = self.preemptions = 0
            self.kv_cache_usage_peak = 0.0
        return values

    @classmethod
    def attach(cls, llm) -> RolloutStats | None:
        """Replace the stat loggers of `llm` (an in-process `vllm.LLM` built with `disable_log_stats=False`) by a
        new `RolloutStats`; None, with a warning, when the engine collects no statistics."""
        from trl_fp8.rollout.vllm._compat import engine_stat_logger_manager

        manager = engine_stat_logger_manager(llm)
        if manager is None or not hasattr(manager, "stat_loggers"):
            logger.warning("This vLLM engine collects no statistics: rollout metrics (vllm/*) are not logged.")
            return None
        stats = cls()
        manager.stat_loggers = [stats]
        return stats


def engine_kv_cache_tokens(llm) -> int | None:
    """The KV-cache size vLLM settled on, in tokens (its "GPU KV cache size"), or None if it does not say."""
    try:
        from trl_fp8.rollout.vllm._compat import engine_cache_config

        cache = engine_cache_config(llm)
        return int(cache.num_gpu_blocks * cache.block_size)
    except (AttributeError, TypeError):
        return None


def capacity_line(
    model: nn.Module, kv_tokens: int, *, fp8_weights: bool, fp8_kv: bool, seq_len: int, rollout_seqs: int = 0
) -> str:
    """`KV cache 197,984 tokens (FP8 weights + FP8 KV cache): room for 85 sequences of 2,304 tokens at once; a BF16
    engine in the same memory would have room for 22.` The BF16 figure moves the weight bytes FP8 saves back into
    BF16 KV cache (`capacity.ModelShape`), and is left out for a model the capacity arithmetic cannot size. Without
    an FP8 KV cache, when a rollout's `rollout_seqs` sequences do not all fit, the line adds what an FP8 KV cache
    would hold in the same memory: the case where it pays (docs/when-fp8-pays.md)."""
    from trl_fp8.rollout.capacity import ModelShape, kv_bytes_per_token, weight_bytes

    kind = ("FP8 weights" if fp8_weights else "BF16 weights") + (" + FP8 KV cache" if fp8_kv else "")
    room = kv_tokens // seq_len
    line = f"KV cache {kv_tokens:,} tokens ({kind}): room for {room:,} sequences of {seq_len:,} tokens at once"
    try:
        shape = ModelShape.from_config(model.config)
    except (ValueError, AttributeError):
        return line + "."
    memory = kv_tokens * kv_bytes_per_token(shape, fp8_kv) + weight_bytes(shape, fp8_weights)

    def room_in_memory(weights_fp8: bool, kv_fp8: bool) -> int:  # sequences another engine would hold there
        return max(0, memory - weight_bytes(shape, weights_fp8)) // kv_bytes_per_token(shape, kv_fp8) // seq_len

    if fp8_weights or fp8_kv:
        line += f"; a BF16 engine in the same memory would have room for {room_in_memory(False, False):,}"
    if not fp8_kv and rollout_seqs > room:
        line += (
            f". The KV cache binds ({rollout_seqs:,} sequences per rollout): an FP8 KV cache (fp8_kv_cache=True) "
            f"would have room for {room_in_memory(fp8_weights, True):,}, for a larger trainer-vs-rollout mismatch "
            "(docs/when-fp8-pays.md)"
        )
    return line + "."
