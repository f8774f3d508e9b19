"""Exact mode (`FP8GRPOConfig(exact_on_policy=True)`) on one SM90 GPU: the trainer's log-probability of every rollout
token equals the colocated engine's bit for bit, through GRPO steps and their weight syncs (max |dlogp| = 0, k3 KL
= 0, an importance ratio of exactly 1, nothing clipped), with a BF16 KV cache and with an FP8 one (the trainer then
quantizes its queries, keys and values with the engine's kernels and scales; the demo's sequences stay short of
position 127, past which FlashAttention-3's FP8 decode parts from its prefill). A child process each: vLLM's
batch-invariant mode is process-wide. On vLLM 0.26, whose batch-invariant mode is not exact, the demo stops at its
config naming vLLM 0.31."""

import ast
import sys
from pathlib import Path

import pytest

from trl_fp8.stack import installed_versions, release

from conftest import clean_subprocess_env, run_child

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fp8_kv_cache", [False, True], ids=["bf16_kv", "fp8_kv"])
def test_exact_mode_gives_the_trainer_the_engines_log_probabilities_bit_for_bit(tmp_path, fp8_kv_cache):
    pytest.importorskip("vllm")
    cmd = [
        sys.executable, str(ROOT / "examples" / "grpo_fp8.py"), "--output_dir", str(tmp_path), "--max_steps", "3",
        "--logging_steps", "1", "--use_vllm", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.25",
        "--exact_on_policy", "true", "--tis", "token", "--save_fp8_checkpoint", "false",
        "--fp8_kv_cache", str(fp8_kv_cache).lower(),
    ]  # fmt: skip
    proc = run_child(cmd, timeout=900, env=clean_subprocess_env())
    tail = proc.stdout[-4000:]
    if release(installed_versions(("vllm",)).get("vllm", "")) == "0.26":  # refused before a model loads
        assert proc.returncode != 0 and "exact_on_policy=True needs vLLM 0.31" in proc.stdout, tail
        return
    assert proc.returncode == 0, tail
    assert "vLLM engine in exact mode: vLLM's batch-invariant kernels" in proc.stdout, tail  # the start-up line
    # The Trainer prints each logging step's metrics as a dict of formatted numbers ('0.003038')
    logs = [{k: float(v) for k, v in ast.literal_eval(line[line.index("{") :]).items() if k.startswith("fp8/mismatch")}
            for line in proc.stdout.splitlines() if "fp8/mismatch/abs_logp_diff_max" in line]  # fmt: skip
    print(f"exact mode ({'FP8' if fp8_kv_cache else 'BF16'} KV cache), per step: " + "; ".join(
        f"max|dlogp| {log['fp8/mismatch/abs_logp_diff_max']}, k3 KL {log['fp8/mismatch/kl_k3']}, "
        f"clipped {log['fp8/mismatch/is_ratio_clipped_frac']}" for log in logs))  # fmt: skip
    assert len(logs) == 3, tail
    for log in logs:  # every step after a weight sync too
        assert log["fp8/mismatch/abs_logp_diff_max"] == 0.0, log
        assert log["fp8/mismatch/kl_k3"] == 0.0, log
        assert log["fp8/mismatch/is_ratio_min"] == 1.0 and log["fp8/mismatch/is_ratio_max"] == 1.0, log
        assert log["fp8/mismatch/is_ratio_clipped_frac"] == 0.0, log
