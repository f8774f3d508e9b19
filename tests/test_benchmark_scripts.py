"""The convergence scripts and the plotting script run end to end on CPU at smoke size (the GPU host runs them at
full size; see benchmarks/README.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def test_pretrain_grpo_and_plots_run_at_smoke_size(tmp_path):
    conv = ROOT / "benchmarks" / "convergence"
    _run(conv / "pretrain.py", "--out", tmp_path / "base", "--size", "smoke", "--max_steps", "4", "--batch_size", "8",
         "--eval_every", "2", "--eval_problems", "8", "--results", tmp_path / "pretrain.json")  # fmt: skip
    pretrain = json.loads((tmp_path / "pretrain.json").read_text())
    assert [e["step"] for e in pretrain["log"]] == [2, 4] and (tmp_path / "base" / "config.json").exists()

    results = tmp_path / "results"  # all five settings at once, through the parallel start-up barrier
    _run(conv / "run_grpo.py", "--model", tmp_path / "base", "--setting", "all", "--parallel", "--steps", "2",
         "--batch_size", "8", "--num_generations", "4", "--eval_every", "1", "--eval_problems", "8", "--no_vllm",
         "--results_dir", results / "convergence", "--workdir", tmp_path / "work")  # fmt: skip
    runs = {p.name: json.loads(p.read_text()) for p in (results / "convergence").glob("grpo_*.json")}
    assert len(runs) == 5, sorted(runs)
    (run,) = [r for name, r in runs.items() if name.startswith("grpo_fp8_tis_")]
    assert run["setting"] == {"name": "fp8_tis", "fp8_recipe": "blockwise", "rollout_precision": "fp8", "tis": "token"}
    assert [s["step"] for s in run["steps"]] == [1, 2] and [e["step"] for e in run["held_out"]] == [0, 1, 2]
    assert run["args"]["parallel"] and "sync_dir" not in run["args"]

    out = _run(ROOT / "benchmarks" / "plot_results.py", "--results", results, "--out", tmp_path / "plots")
    assert "convergence_accuracy.png" in out and (tmp_path / "plots" / "convergence_reward.png").stat().st_size > 0


def test_long_completion_task_pretrains_and_runs_grpo_at_smoke_size(tmp_path):
    """`--task trace`: word-level tokenizer, 4k-word vocabulary, completions up to 771 tokens, through the same
    pre-training and GRPO scripts; its results stay out of the addition plots."""
    conv = ROOT / "benchmarks" / "convergence"
    _run(conv / "pretrain.py", "--task", "trace", "--out", tmp_path / "base", "--size", "smoke", "--max_steps", "2",
         "--batch_size", "2", "--eval_every", "2", "--eval_problems", "2", "--results", tmp_path / "pretrain.json")  # fmt: skip
    pretrain = json.loads((tmp_path / "pretrain.json").read_text())
    assert pretrain["args"]["task"] == "trace" and [e["step"] for e in pretrain["log"]] == [2]
    assert json.loads((tmp_path / "base" / "config.json").read_text())["vocab_size"] == 4224
    results = tmp_path / "results" / "convergence_trace"
    _run(conv / "run_grpo.py", "--task", "trace", "--model", tmp_path / "base", "--setting", "fp8_tis", "--steps", "1",
         "--batch_size", "4", "--micro_batch", "2", "--num_generations", "2", "--eval_every", "1", "--eval_problems",
         "2", "--no_vllm", "--results_dir", results, "--workdir", tmp_path / "work")  # fmt: skip
    (run,) = [json.loads(p.read_text()) for p in results.glob("grpo_*.json")]
    assert run["args"]["task"] == "trace" and [e["step"] for e in run["held_out"]] == [0, 1]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plot_results import _convergence_runs

    assert _convergence_runs(tmp_path / "results") == [] and len(_convergence_runs(tmp_path / "results", "trace")) == 1


def test_rollout_plot_reads_both_result_formats(tmp_path):
    """bench_rollout rows with `points` (sequences x new tokens per point) and the first format's `gen_<tokens>`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plot_results import plot_rollout, rollout_points

    def point(seqs, new, tps):
        return {"seqs": seqs, "new_tokens": new, "tokens_per_s": tps}

    new = {"device": "X", "shape": {"name": "8b"}, "results": [
        {"engine": "bf16", "points": [point(64, 1024, 100.0), point(256, 1024, 200.0)]},
        {"engine": "fp8_deepgemm", "points": [point(64, 1024, 130.0)]},
    ]}  # fmt: skip
    old = {"results": [{"engine": "bf16", "gen_1024": {"prompts": 256, "tokens_per_s": 5.0}}]}
    assert rollout_points(new) == {"bf16": {"64x1024": 100.0, "256x1024": 200.0}, "fp8_deepgemm": {"64x1024": 130.0}}
    assert rollout_points(old) == {"bf16": {"256x1024": 5.0}}
    assert plot_rollout(new, tmp_path, plt).exists()


def test_linear_and_gemm_benchmarks_run_at_smoke_size(tmp_path):
    """bench_linear (with its profile) and bench_gemm on CPU at tiny shapes: the emulated backend through the same
    code the GPU run takes, so a changed kernel-layer interface breaks here, not on the lent GPU host."""
    out = _run(ROOT / "benchmarks" / "bench_linear.py", "--quick", "--profile", tmp_path / "profile",
               "--out", tmp_path / "linear.json")  # fmt: skip
    result = json.loads((tmp_path / "linear.json").read_text())
    assert {r["shape"] for r in result["results"]} == {"tiny_a", "tiny_b", "tiny_ab"}
    assert "tiny_ab" in result["profile_per_iteration"] and "unaccounted" in out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plot_results import linear_speedups, plot_linear

    result["results"].append({"shape": "tiny_a", "variant": "broken", "error": "RuntimeError: x"})  # a failed variant
    speedups = linear_speedups(result)
    assert "broken" not in speedups and "bf16" not in speedups
    assert set(speedups["trl_fp8 blockwise (cached W)"]) == {"tiny_a", "tiny_b", "tiny_ab"}
    assert plot_linear(result, tmp_path, plt).exists()
    out = _run(ROOT / "benchmarks" / "bench_gemm.py", "--quick", "--out", tmp_path / "gemm.json")
    rows = json.loads((tmp_path / "gemm.json").read_text())["results"]
    assert {(r["gemm"], r["variant"]) for r in rows} >= {("wgrad", "emulated"), ("fprop", "bf16 mm")}
    assert all(r.get("rel_err_vs_emulation", 0.0) == 0.0 and "error" not in r for r in rows)
