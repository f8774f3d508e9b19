"""Rollout statistics (`trl_fp8.rollout.stats`): what vLLM's scheduler reports becomes per-rollout metrics, and the
line on what the KV cache holds against a BF16 engine's (or, where the BF16 KV cache binds, an FP8 one's)."""

import types

import torch

from trl_fp8.demo.tiny_model import tiny_qwen3

from fake_vllm import tiny_trainer


def test_rollout_statistics_and_the_capacity_line_reach_the_logs(fake_vllm, tmp_path, capsys):
    """What vLLM's scheduler reports after each engine step (its stat-logger interface) becomes per-rollout metrics;
    after the first rollout one line says how many sequences the KV cache holds, and what BF16 would."""
    from trl_fp8.rollout.stats import RolloutStats

    engine = types.SimpleNamespace(llm_engine=types.SimpleNamespace(logger_manager=types.SimpleNamespace(
        stat_loggers=["vLLM's logging and Prometheus loggers"])))  # fmt: skip
    stats = RolloutStats.attach(engine)
    assert engine.llm_engine.logger_manager.stat_loggers == [stats]
    assert RolloutStats.attach(types.SimpleNamespace(llm_engine=types.SimpleNamespace())) is None  # stats off

    trainer = tiny_trainer(tmp_path, fp8_kv_cache=True)
    report = trainer.vllm_generation.report
    report.rollout_stats, report.kv_cache_tokens = stats, 197_984
    for running, waiting, usage, preempted in ((40, 88, 0.5, 0), (85, 43, 0.99, 2), (12, 0, 0.3, 1)):
        stats.record(types.SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage),
                     types.SimpleNamespace(num_preempted_reqs=preempted))  # fmt: skip
    output = {"prompt_mask": torch.ones(16, 10, dtype=torch.long), "prompt_ids": torch.ones(16, 10)}
    trainer._log_rollout_capacity(output, "train")
    metrics = {k: v for k, v in trainer._metrics["train"].items() if k.startswith("vllm/")}
    assert metrics == {"vllm/running_peak": [85.0], "vllm/waiting_peak": [88.0], "vllm/preemptions": [3.0],
                       "vllm/kv_cache_usage_peak": [0.99], "vllm/kv_cache_tokens": [197984.0]}  # fmt: skip
    seq_len = 10 + trainer.max_completion_length
    line = capsys.readouterr().out
    assert (
        f"KV cache 197,984 tokens (FP8 weights + FP8 KV cache): room for {197_984 // seq_len:,} sequences of {seq_len}"
        in line
    )
    assert "a BF16 engine in the same memory would have room for" in line
    trainer._log_rollout_capacity(output, "train")  # the line once; the metrics every rollout, from zero again
    assert capsys.readouterr().out == "" and trainer._metrics["train"]["vllm/running_peak"] == [85.0, 0.0]


def test_the_bf16_equivalent_moves_the_saved_weight_bytes_into_bf16_kv_cache():
    from trl_fp8.rollout.capacity import ModelShape, kv_bytes_per_token, weight_bytes
    from trl_fp8.rollout.stats import capacity_line

    model = tiny_qwen3()
    shape = ModelShape.from_config(model.config)
    tokens = 100_000
    saved = weight_bytes(shape, False) - weight_bytes(shape, True)
    expected = (tokens * kv_bytes_per_token(shape, True) - saved) // kv_bytes_per_token(shape, False) // 100
    line = capacity_line(model, tokens, fp8_weights=True, fp8_kv=True, seq_len=100)
    assert line.endswith(f"would have room for {expected:,}.") and "1,000 sequences of 100 tokens" in line
    assert capacity_line(model, tokens, fp8_weights=False, fp8_kv=False, seq_len=100).endswith("at once.")


def test_a_kv_bound_rollout_without_fp8_kv_cache_is_told_what_fp8_kv_would_hold():
    from trl_fp8.rollout.capacity import ModelShape, kv_bytes_per_token
    from trl_fp8.rollout.stats import capacity_line

    model = tiny_qwen3()
    shape = ModelShape.from_config(model.config)
    tokens = 100_000  # FP8 weights, BF16 KV: the same memory in FP8 KV holds twice the tokens
    fp8_kv_room = tokens * kv_bytes_per_token(shape, False) // kv_bytes_per_token(shape, True) // 100
    bound = capacity_line(model, tokens, fp8_weights=True, fp8_kv=False, seq_len=100, rollout_seqs=1_500)
    assert bound.endswith(f"an FP8 KV cache (fp8_kv_cache=True) would have room for {fp8_kv_room:,}, for a larger "
                          "trainer-vs-rollout mismatch (docs/when-fp8-pays.md).")  # fmt: skip
    assert "The KV cache binds (1,500 sequences per rollout)" in bound and fp8_kv_room == 2_000
    fits = capacity_line(model, tokens, fp8_weights=True, fp8_kv=False, seq_len=100, rollout_seqs=1_000)
    assert "binds" not in fits and "FP8 KV" not in fits  # every sequence fits: nothing to suggest
    already = capacity_line(model, tokens, fp8_weights=True, fp8_kv=True, seq_len=100, rollout_seqs=1_500)
    assert "binds" not in already  # an FP8 KV cache already: nothing to suggest
    bf16 = capacity_line(model, tokens, fp8_weights=False, fp8_kv=False, seq_len=100, rollout_seqs=1_500)
    assert "BF16 engine in the same memory" not in bf16 and "would have room for 2,000" in bf16
