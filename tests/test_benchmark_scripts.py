"""The benchmark scripts (the `benchmarks` package) run end to end on CPU at smoke size, as modules from the
repository root (the GPU host runs them at full size; see benchmarks/README.md), and their helpers compute what the
results files record."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.benchmark_scripts  # not in the default run: `python -m pytest -m benchmark_scripts` runs them
PRETRAIN, RUN_GRPO = "benchmarks.convergence.pretrain", "benchmarks.convergence.run_grpo"


def _run(module, *args, profiler_crash_retry: bool = False):
    """`python -m module args...` from the repository root, as benchmarks/README.md runs the scripts.

    `profiler_crash_retry`: one more try when the process died of a segfault just as torch's profiler started (torch
    2.13's kineto on a loaded CPU: "Not starting tracing - insufficient time for warmup", then SIGSEGV, seen once in
    CI with passing runs before and after); any other failure, or the same crash twice, fails the test."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    if profiler_crash_retry and proc.returncode == -signal.SIGSEGV and "profiler_start" in proc.stdout + proc.stderr:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def test_pretrain_grpo_and_plots_run_at_smoke_size(tmp_path):
    _run(PRETRAIN, "--out", tmp_path / "base", "--size", "smoke", "--max_steps", "4", "--batch_size", "8",
         "--eval_every", "2", "--eval_problems", "8", "--results", tmp_path / "pretrain.json")  # fmt: skip
    pretrain = json.loads((tmp_path / "pretrain.json").read_text())
    assert [e["step"] for e in pretrain["log"]] == [2, 4] and (tmp_path / "base" / "config.json").exists()

    results = tmp_path / "results"  # all six settings at once, through the parallel start-up barrier
    _run(RUN_GRPO, "--model", tmp_path / "base", "--setting", "all", "--parallel", "--steps", "2",
         "--batch_size", "8", "--num_generations", "4", "--eval_every", "1", "--eval_problems", "8", "--no_vllm",
         "--results_dir", results / "convergence", "--workdir", tmp_path / "work")  # fmt: skip
    runs = {p.name: json.loads(p.read_text()) for p in (results / "convergence").glob("grpo_*.json")}
    assert len(runs) == 6, sorted(runs)
    (run,) = [r for name, r in runs.items() if name.startswith("grpo_fp8_tis_") and "fp8kv" not in name]
    assert run["setting"] == {"name": "fp8_tis", "fp8_recipe": "blockwise", "rollout_precision": "fp8", "tis": "token",
                              "fp8_kv_cache": False}  # fmt: skip
    assert [s["step"] for s in run["steps"]] == [1, 2] and [e["step"] for e in run["held_out"]] == [0, 1, 2]
    assert run["args"]["parallel"] and "sync_dir" not in run["args"]

    out = _run("benchmarks.plot_results", "--results", results, "--out", tmp_path / "plots")
    assert "convergence_accuracy.png" in out and (tmp_path / "plots" / "convergence_reward.png").stat().st_size > 0


def test_pretraining_in_micro_batches_takes_the_whole_batchs_step():
    """`--micro_batch`: slices of a batch whose token-weighted losses add up to the whole batch's mean, so the step is
    the same one (fp32 on CPU: only the order of the sums differs, whose float32 rounding stays orders of magnitude
    below the bound; weighting the slices by rows instead of tokens breaks it)."""
    import torch

    from benchmarks.convergence.pretrain import build, load_task, train_step

    task = load_task("chain")
    updated = []
    for micro_batch in (None, 3):
        model, tokenizer = build(task, "smoke", seed=0)
        ids, labels = task.Batcher(tokenizer)(task.problems(7, seed=1), "cpu")  # 7 rows: slices of 3, 3 and 1
        assert (labels[:, 1:] != -100).sum(dim=1).unique().numel() > 1  # rows of different lengths: weights matter
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        loss = train_step(model, optimizer, schedule, ids, labels, micro_batch)
        updated.append((loss, [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]))
    (loss_whole, step_whole), (loss_sliced, step_sliced) = updated
    torch.testing.assert_close(loss_sliced, loss_whole, rtol=1e-5, atol=0)
    for sliced, whole in zip(step_sliced, step_whole, strict=True):
        torch.testing.assert_close(sliced, whole, rtol=1e-4, atol=1e-6 * whole.abs().max().item())


def test_long_completion_task_pretrains_and_runs_grpo_at_smoke_size(tmp_path):
    """`--task chain`: word-level tokenizer, completions up to 864 tokens, through the same pre-training and GRPO
    scripts; its results stay out of the addition plots."""
    _run(PRETRAIN, "--task", "chain", "--out", tmp_path / "base", "--size", "smoke", "--max_steps", "2",
         "--batch_size", "2", "--eval_every", "2", "--eval_problems", "2", "--results", tmp_path / "pretrain.json")  # fmt: skip
    pretrain = json.loads((tmp_path / "pretrain.json").read_text())
    assert pretrain["args"]["task"] == "chain" and [e["step"] for e in pretrain["log"]] == [2]
    assert json.loads((tmp_path / "base" / "config.json").read_text())["vocab_size"] == 128
    results = tmp_path / "results" / "convergence_chain"
    _run(RUN_GRPO, "--task", "chain", "--model", tmp_path / "base", "--setting", "fp8_tis", "--steps", "3",
         "--max_minutes", "1e-6", "--batch_size", "4", "--micro_batch", "2", "--num_generations", "2", "--eval_every",
         "5", "--eval_problems", "2", "--no_vllm", "--results_dir", results, "--workdir", tmp_path / "work")  # fmt: skip
    (run,) = [json.loads(p.read_text()) for p in results.glob("grpo_*.json")]
    # the deadline passed during step 1: training stopped there and the model was evaluated there
    assert run["args"]["task"] == "chain" and [e["step"] for e in run["held_out"]] == [0, 1]
    assert run["stopped_by_deadline"] == 1 and [s["step"] for s in run["steps"]] == [1]
    from benchmarks.plot_results import _convergence_runs

    assert _convergence_runs(tmp_path / "results") == [] and len(_convergence_runs(tmp_path / "results", "chain")) == 1


def test_the_fp8kv_study_gets_its_own_table_and_stays_out_of_the_reports_seeds(tmp_path):
    """`convergence_fp8kv/` (`run_rollout_report.sh fp8kv`) is one question on one host: its runs are not more seeds of
    the report's `convergence/` runs; its table gives the accuracy's standard error, the KL and the TIS clipping."""
    from benchmarks.plot_results import _convergence_runs, tables

    def run(folder, setting, kl, clipped=None):
        steps = [{"step": i, "reward": 0.5, "fp8/mismatch/kl_k3": kl * i, "fp8/mismatch/abs_logp_diff_mean": 0.01,
                  **({"fp8/mismatch/is_ratio_clipped_frac": clipped} if clipped is not None else {})}
                 for i in (1, 2, 3)]  # fmt: skip
        held_out = [{"step": 0, "held_out_accuracy": 0.5}, {"step": 3, "held_out_accuracy": 0.9}]
        path = tmp_path / folder / f"grpo_{setting}_GPU.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"setting": {"name": setting}, "args": {"seed": 0, "eval_problems": 100},
                                    "steps": steps, "held_out": held_out, "device": "GPU", "date": "today"}))  # fmt: skip

    run("convergence", "fp8_tis", 1e-5, 0.0)
    run("convergence_fp8kv", "bf16", 1e-5)
    run("convergence_fp8kv", "fp8_tis_fp8kv", 1e-4, 0.002)
    assert [r["setting"]["name"] for r in _convergence_runs(tmp_path)] == ["fp8_tis"]
    assert len(_convergence_runs(tmp_path, folder="convergence_fp8kv")) == 2
    text = tables(tmp_path)
    # accuracy 90% of 100 problems: standard error 3%; KL of steps 1-3 = 1e-4, 2e-4, 3e-4: mean and median 2e-4
    assert "| fp8_tis_fp8kv | 0 | 50.00 | 3 | 90.00 +- 3.00 | 2.0e-04 | 2.0e-04 | 0.200% | 0.0100 |" in text
    assert "| bf16 | 0 | 50.00 | 3 | 90.00 +- 3.00 | 2.0e-05 | 2.0e-05 | - (no TIS) | 0.0100 |" in text


def test_rollout_plot_reads_both_result_formats(tmp_path):
    """bench_rollout rows with `points` (sequences x new tokens per point) and the first format's `gen_<tokens>`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plot_results import plot_rollout, rollout_points

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


def report_phase(name: str) -> str:
    """The body of one phase of `benchmarks/run_rollout_report.sh` (its `case` branch)."""
    script = (Path(__file__).parents[1] / "benchmarks" / "run_rollout_report.sh").read_text()
    start = script.index(f"\n{name})")
    return script[start : script.index("\n  ;;", start)]


def test_every_engine_variant_and_decode_phase_engine_is_a_bench_rollout_engine():
    """The one-setting engine variants (`ENGINE_LLM_KWARGS`) are engines `bench_rollout` knows, the variants of the
    FP8 KV cache keep their cache, and `run_rollout_report.sh decode` runs only engines it knows."""
    import re

    from benchmarks.bench_rollout import ENGINE_LLM_KWARGS, ENGINES

    assert set(ENGINE_LLM_KWARGS) <= set(ENGINES)
    for name, kwargs in ENGINE_LLM_KWARGS.items():
        assert ENGINES[name][2] == ("attention_backend" in kwargs or "_kv_" in name), name
    engines = re.search(r"DECODE_ENGINES:-([^}]*)}", report_phase("decode")).group(1).replace("\\", " ").split()
    assert len(engines) >= 5 and set(engines) <= set(ENGINES), engines
    assert set(ENGINE_LLM_KWARGS) <= set(engines)  # every variant is measured by the phase


def test_the_moedecode_phase_runs_every_moe_backend_variant_at_a_moe_shape():
    """`run_rollout_report.sh moedecode`: engines bench_rollout knows, every MoE backend variant among them, at a
    mixture-of-experts shape; a MoE variant at a dense shape is refused before any engine starts."""
    import re
    import sys

    from benchmarks.bench_rollout import ENGINE_ENV, ENGINE_LLM_KWARGS, ENGINES, MOE_ENGINE_LLM_KWARGS, MOE_SHAPES

    phase = report_phase("moedecode").replace("\\\n", " ")
    engines = re.search(r"MOE_ENGINES:-([^}]*)}", phase).group(1).replace("\\", " ").split()
    assert set(engines) <= set(ENGINES) and set(MOE_ENGINE_LLM_KWARGS) <= set(engines), engines
    assert re.search(r"CAPACITY_SHAPE=(\S+)", phase).group(1) in MOE_SHAPES
    assert set(ENGINE_ENV) <= set(MOE_ENGINE_LLM_KWARGS) | set(ENGINE_LLM_KWARGS)  # an environment: a variant's
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_rollout", "--engine", "fp8_deepgemm_moe_deepgemm",
                           "--shape", "8b"], capture_output=True, text=True, cwd=Path(__file__).parents[1])  # fmt: skip
    assert proc.returncode != 0 and "use a MoE --shape" in proc.stderr


def test_the_colocate_and_chainkv_phases_name_runs_settings_and_tasks_that_exist():
    """A misspelt run, setting or task in `run_rollout_report.sh` would fail only on the GPU host, after staging."""
    import re

    from benchmarks.bench_grpo import RUNS
    from benchmarks.convergence.pretrain import TASKS
    from benchmarks.convergence.run_grpo import SETTINGS

    runs = re.search(r"COLOCATE_RUNS:-([^}]*)}", report_phase("colocate")).group(1).split()
    assert {"trl_bf16", "fp8_defaults"} <= set(runs) <= set(RUNS), runs
    chainkv = report_phase("chainkv").replace("\\\n", " ")
    settings = re.search(r"--setting ((?:\w+ )+)--", chainkv).group(1).split()
    assert settings == ["bf16", "fp8_tis", "fp8_tis_fp8kv"] and set(settings) <= set(SETTINGS)
    assert set(re.findall(r"--task (\w+)", chainkv)) == {"chain_long"} <= set(TASKS)


FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stands in for `python` in run_rollout_report.sh: the GPU name, and bench_* calls logged with the GPU they were
# given and written as results files (rows appended, as --append does); anything else runs in the real Python.
if [ "$1" = -c ]; then echo GPU_X; exit 0; fi
case "$2" in
benchmarks.bench_grpo|benchmarks.bench_rollout)
  echo "$CUDA_VISIBLE_DEVICES $*" >>"$FAKE_LOG"
  exec "$REAL_PYTHON" - "$@" <<'PY'
import json, sys
from pathlib import Path
args = sys.argv[1:]
def value(flag):
    return args[args.index(flag) + 1]
grpo = args[1] == "benchmarks.bench_grpo"
out, key = Path(value("--out")), "name" if grpo else "engine"
rest = args[args.index("--runs" if grpo else "--engines") + 1 :]
names = rest[: next((i for i, a in enumerate(rest) if a.startswith("-")), len(rest))]
result = json.loads(out.read_text()) if out.exists() else {"device": "GPU X", "settings": {"shape": "8b"},
    "shape": "8b", "prompt_len": 256, "gpu_memory_utilization": 0.3, "max_num_seqs": None, "results": []}
result["results"] += [{key: name} for name in names]
out.write_text(json.dumps(result))
PY
  ;;
*) exec "$REAL_PYTHON" "$@" ;;
esac
"""


def run_phase(tmp_path, phase: str, **env) -> tuple[list[str], Path]:
    """`run_rollout_report.sh phase` with a fake `python` (FAKE_PYTHON): the bench calls it made, and its $WORK."""
    import os
    import shutil
    import subprocess
    import sys

    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    assert shutil.which("bash")
    script = Path(__file__).parents[1] / "benchmarks" / "run_rollout_report.sh"
    environment = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "WORK": str(work),
                   "REAL_PYTHON": sys.executable, "FAKE_LOG": str(tmp_path / "calls.log"), **env}  # fmt: skip
    environment["PYTHONPATH"] = str(script.parents[1])
    subprocess.run(["bash", str(script), phase], env=environment, check=True, capture_output=True, timeout=120)
    return (tmp_path / "calls.log").read_text().splitlines(), work


def test_phases_deal_their_runs_over_the_gpus_given_and_merge_one_file(tmp_path):
    """`COLOCATE_GPUS` / `CAPACITY_GPUS`: run i on GPU i mod n, each GPU's runs one after the other into its own file,
    the GPUs at once; then one merged results file with which runs ran together. Unset: one GPU, one file."""
    import json

    calls, work = run_phase(tmp_path, "colocate", COLOCATE_GPUS="2 3 1", COLOCATE_RUNS="a b c d")
    gpu_of = {call.split("--runs ")[1].split()[0]: call.split()[0] for call in calls}
    assert gpu_of == {"a": "2", "b": "3", "c": "1", "d": "2"}
    assert all("--append" in call and f"lane{call.split()[0]}" in call for call in calls)
    merged = json.loads((work / "grpo_colocate_8b_GPU_X.json").read_text())
    assert sorted(row["name"] for row in merged["results"]) == ["a", "b", "c", "d"]
    assert sorted(map(sorted, merged["ran_at_once"])) == [["a", "d"], ["b"], ["c"]]

    calls, work = run_phase(tmp_path / "capacity", "capacity", CAPACITY_GPUS="0 1", CAPACITY_ENGINES="e1 e2 e3")
    assert sorted((call.split()[0], call.split("--engines ")[1].split()[0]) for call in calls) == [
        ("0", "e1"), ("0", "e3"), ("1", "e2")]  # fmt: skip
    merged = json.loads((work / "rollout_capacity_mem0.3_GPU_X.json").read_text())
    assert sorted(map(sorted, merged["ran_at_once"])) == [["e1", "e3"], ["e2"]]

    calls, work = run_phase(tmp_path / "one", "colocate", COLOCATE_RUNS="a b")
    assert len(calls) == 2 and all("CUDA" not in call and "lane" not in call for call in calls)
    rows = json.loads((work / "grpo_colocate_8b_GPU_X.json").read_text())["results"]
    assert [row["name"] for row in rows] == ["a", "b"]


def test_rollout_summary_gives_each_profiled_engine_its_kernel_time_and_attention_floor():
    """`bench_rollout --profile_point SxN`: the summary adds, per profiled engine, the kernel milliseconds by category,
    attention's KV-read floor (absent without a known device) and the time no kernel ran."""
    from benchmarks.bench_rollout import parse_point, summary

    assert parse_point("128x4096") == (128, 4096)
    point = {"seqs": 128, "new_tokens": 4096, "tokens_per_s": 100.0, "of_floor": 0.5}
    row = {"linear_kernel": "k", "engine_start_s": 1.0, "weight_sync_ms": 2.0, "points": [point]}
    profile = {"seqs": 128, "new_tokens": 1024, "kernel_ms_by_category": {"attention": 900.0, "gemm, fp8": 300.0}}
    rows = [row | {"engine": "bf16"}, row | {"engine": "fp8_cutlass_kv", "profile": profile | {"attention_kv_floor_ms": 450.0}},
            row | {"engine": "fp8_cutlass", "profile": profile}]  # fmt: skip
    lines = summary(rows).splitlines()
    assert lines[-2] == "fp8_cutlass_kv 128x1024 kernel ms: attention 900, gemm, fp8 300 (attention's KV floor 450)"
    assert lines[-1] == "fp8_cutlass 128x1024 kernel ms: attention 900, gemm, fp8 300"
    assert sum("kernel ms" in line for line in lines) == 2
    timed = profile | {"timeline": {"span_ms": 1500.0, "idle_ms": 240.0}}  # the GPU waiting on the host
    assert summary([row | {"engine": "fp8_deepgemm_kv", "profile": timed}]).endswith("; GPU idle 240 of 1500 ms")


def test_linear_and_gemm_benchmarks_run_at_smoke_size(tmp_path):
    """bench_linear (with its profile) and bench_gemm on CPU at tiny shapes: the emulated backend through the same
    code the GPU run takes, so a changed kernel-layer interface breaks here, not on the lent GPU host."""
    out = _run("benchmarks.bench_linear", "--quick", "--profile", tmp_path / "profile",
               "--out", tmp_path / "linear.json")  # fmt: skip
    result = json.loads((tmp_path / "linear.json").read_text())
    assert {r["shape"] for r in result["results"]} == {"tiny_a", "tiny_b", "tiny_ab"}
    assert "tiny_ab" in result["profile_per_iteration"] and "unaccounted" in out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plot_results import linear_speedups, plot_linear

    result["results"].append({"shape": "tiny_a", "variant": "broken", "error": "RuntimeError: x"})  # a failed variant
    speedups = linear_speedups(result)
    assert "broken" not in speedups and "bf16" not in speedups
    assert set(speedups["trl_fp8 blockwise (cached W)"]) == {"tiny_a", "tiny_b", "tiny_ab"}
    assert plot_linear(result, tmp_path, plt).exists()
    out = _run("benchmarks.bench_gemm", "--quick", "--out", tmp_path / "gemm.json")
    rows = json.loads((tmp_path / "gemm.json").read_text())["results"]
    assert {(r["gemm"], r["variant"]) for r in rows} >= {("wgrad", "emulated"), ("fprop", "bf16 mm")}
    assert all(r.get("rel_err_vs_emulation", 0.0) == 0.0 and "error" not in r for r in rows)


def test_saved_activation_counts_at_smoke_size(tmp_path):
    """FP8 keeps fewer bytes for backward than BF16, and the fused MLP exactly one [tokens, intermediate] BF16
    tensor less than the unfused FP8 layer (silu(gate), recomputed in backward)."""
    _run("benchmarks.bench_saved_activations", "--quick", "--out", tmp_path / "saved.json")
    rows = {r["setting"]: r for r in json.loads((tmp_path / "saved.json").read_text())["results"]}
    outside = {k: r["bytes_per_token_outside_attention_core"] for k, r in rows.items()}
    assert outside["bf16"] > outside["fp8"] > outside["fp8_fused"]
    assert outside["fp8"] - outside["fp8_fused"] == 2 * 768  # the tiny shape's intermediate size, BF16
    assert rows["fp8"]["bytes_per_token"]["norms"] == rows["bf16"]["bytes_per_token"]["norms"]  # norms stay BF16


def test_allocator_segments_split_free_bytes_by_whether_empty_cache_can_return_them():
    """A segment with a live block pins its free bytes; a segment with none is returned by `empty_cache`; a private
    pool's (vLLM's sleep-mode pool) bytes are counted apart."""
    from benchmarks.bench_grpo import allocator_segments

    snapshot = [
        {"total_size": 20 << 20, "allocated_size": 2 << 20, "segment_pool_id": (0, 0)},
        {"total_size": 8 << 20, "allocated_size": 0, "segment_pool_id": (0, 0)},
        {"total_size": 4 << 20, "allocated_size": 4 << 20, "segment_pool_id": (1, 0)},
    ]
    assert allocator_segments(snapshot) == {
        "segments": 3,
        "free_releasable": 8 << 20,
        "free_pinned": 18 << 20,
        "private_pool_reserved": 4 << 20,
    }


def test_collect_bestfit_keeps_the_runs_that_ran_out_of_memory(tmp_path):
    """A run that failed wrote no row: its outcome comes from the status file and its log's error line."""
    from benchmarks.collect_bestfit import main as collect

    header = {"device": "GPU", "date": "2026-11-26", "versions": {}, "settings": {"vllm_memory": 0.4, "shape": "8b",
              "cuda_alloc_conf": "expandable_segments:True"}}  # fmt: skip
    row = {"name": "trl_bf16", "step_time": {"step_s": 97.5}}
    (tmp_path / "grpo_bestfit_trl_bf16_mem0.4_GPU.json").write_text(json.dumps(header | {"results": [row]}))
    (tmp_path / "bestfit_trl_bf16_0.45.log").write_text("step\n[rank0]: RuntimeError: CUDA Error: out of memory\n")
    (tmp_path / "status.txt").write_text("START bestfit\nbestfit_trl_bf16_0.4 rc=0 seconds=359\n"
                                         "bestfit_trl_bf16_0.45 rc=1 seconds=167\ncapacity_mem0.5 rc=0\n")  # fmt: skip
    out = tmp_path / "bestfit.json"
    collect([str(tmp_path), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["settings"] == {"shape": "8b"} and result["device"] == "GPU"
    ran, failed = result["results"]
    assert (ran["vllm_memory"], ran["ran"], ran["row"], ran["cuda_alloc_conf"]) == (
        0.4,
        True,
        row,
        "expandable_segments:True",
    )
    assert (failed["vllm_memory"], failed["ran"], failed["row"]) == (0.45, False, None)
    assert failed["cuda_alloc_conf"] == "expandable_segments:True"  # the folder's setting, from the row that ran
    assert failed["error"] == "RuntimeError: CUDA Error: out of memory"


def test_grpo_medians_leave_out_the_profiled_step_and_after(tmp_path):
    """bench_grpo times the steps after the warm-up and before the profiled one (reading a profile takes tens of
    seconds and lands in the next step); `--resummarize` recomputes a results file's medians from its per-step
    times; the kernel categories do not file `gpu_kernel_impl_nocast` elementwise kernels under casts, and file
    vLLM's block-FP8 GEMM and activation quantizers as FP8."""
    from benchmarks.bench_grpo import median_steps, mismatch_medians, model_positions, step_medians
    from benchmarks.common import kernel_category as category

    assert model_positions(128, 1024) == 4096 and model_positions(128, 4096) == 8192  # the long regime's context

    assert median_steps(6, 1, 5) == [1, 2, 3, 4] and median_steps(6, 2, None) == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="no step left"):
        median_steps(6, 3, 3)
    with pytest.raises(ValueError, match="not one of the 6 steps"):
        median_steps(6, 1, 6)
    from types import SimpleNamespace

    from benchmarks.bench_grpo import first_profiled_step

    # a profiled rollout ends the medians too, whichever of the two profiled steps comes first
    assert first_profiled_step(SimpleNamespace(profile_step=5, profile_rollout_step=3)) == 3
    assert first_profiled_step(SimpleNamespace(profile_step=None, profile_rollout_step=None)) is None
    assert first_profiled_step(SimpleNamespace(profile_step=2)) == 2
    per_step = {"step_s": [30.0, 10.0, 12.0, 11.0, 60.0], "rollout_s": [5.0, 4.0, 4.0, 4.0, 4.0],
                "weight_sync_s": [1.0, 0.5, 0.5, 0.5, 0.5]}  # fmt: skip
    medians = step_medians(per_step, [1, 2, 3])
    assert medians == {"step_s": 11.0, "rollout_s": 4.0, "weight_sync_s": 0.5, "training_s": 6.5}
    # where the scoring and the optimizer step were timed, the training phase splits into them and the micro-batches
    parts = {"scoring_s": [3.0, 1.0, 1.5, 1.0, 1.0], "optimizer_s": [0.5, 0.25, 0.25, 0.5, 0.25]}
    medians = step_medians({**per_step, **parts}, [1, 2, 3])
    assert medians["scoring_s"] == 1.0 and medians["optimizer_s"] == 0.25
    assert medians["micro_batches_s"] == 5.0  # of steps 1-3: 5.5 - 1.0 - 0.25, 7.5 - 1.5 - 0.25, 6.5 - 1.0 - 0.5
    # the mismatch metrics of the same steps (log entries count steps from 1), other keys and steps left out
    history = [
        {"step": s, "fp8/mismatch/kl_k3": kl, "sampling/sampling_logp_difference/mean": d, "loss": 1.0}
        for s, kl, d in [(1, 9.0, 9.0), (2, 1.0, 0.1), (3, 3.0, 0.3), (4, 2.0, 0.2), (5, 7.0, 7.0)]
    ]
    history.append({"train_runtime": 1.0, "step": 5})
    assert mismatch_medians(history, [1, 2, 3]) == {"fp8/mismatch/kl_k3": 2.0,
                                                   "sampling/sampling_logp_difference/mean": 0.2}  # fmt: skip

    path = tmp_path / "grpo.json"
    row = {"name": "trl_bf16", "step_time": {}, "per_step": per_step}
    path.write_text(json.dumps({"settings": {}, "results": [row]}))
    _run("benchmarks.bench_grpo", "--resummarize", path, "--median_steps", "1", "2")
    result = json.loads(path.read_text())
    assert result["settings"]["median_steps"] == [1, 2]
    assert result["results"][0]["step_time"] == {"step_s": 11.0, "rollout_s": 4.0, "weight_sync_s": 0.5,
                                                 "training_s": 6.5}  # fmt: skip

    elementwise = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16>"
    assert category(elementwise) != "copies / casts"
    assert (
        category("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda")
        == "copies / casts"
    )
    flash = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t"
    assert category(flash) == "attention"
    # vLLM's block-FP8 rollout kernels, as named in the 2026-11-24 kvprofile (H200, vLLM 0.26)
    assert (
        category("void cutlass::device_kernel<vllm::cutlass_3x_gemm_fp8_blockwise<cutlass::bfloat16_t, 1, 128")
        == "gemm, fp8"
    )
    assert category("nvjet_sm90_tst_192x64_64x6_1x2_h_bz_TNT") == "gemm, bf16"
    for quantizer in (
        "void vllm::rms_norm_per_block_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn, true, true, 128>",
        "void vllm::silu_and_mul_per_block_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn, true, 128>",
        "void per_token_group_quant_8bit_kernel<c10::BFloat16, c10::Float8_e4m3fn, true, false, float>",
    ):
        assert category(quantizer) == "fp8 quantization (vLLM)"
    assert category("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN") == "gemm, fp8"
    assert category("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 12288u") == "gemm, fp8"
    assert category("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "gemm, bf16"


def test_append_keeps_rows_of_the_same_regime_and_refuses_another(tmp_path):
    """`--append` keeps the earlier rows that are not re-run when device and regime match (rows measured over other
    steps included); a file of another regime is refused by name, never overwritten with its rows dropped."""
    from benchmarks.common import previous_rows

    out = tmp_path / "grpo.json"
    rows = [{"name": "trl_bf16", "measured": {"steps": 3}}, {"name": "unified", "measured": {"steps": 3}}]
    out.write_text(json.dumps({"device": "H200", "settings": {"shape": "1.7b", "steps": 3}, "results": rows}))
    now = {"device": "H200", "settings": {"shape": "1.7b", "steps": 2}}
    assert previous_rows(out, now, ("settings.shape",), "name", ["unified"]) == rows[:1]
    with pytest.raises(SystemExit, match=r"settings.shape: '1.7b' there, '8b' now.*another --out"):
        previous_rows(out, {**now, "settings": {"shape": "8b"}}, ("settings.shape",), "name", ["unified"])
    with pytest.raises(SystemExit, match="device: 'H200' there, 'H100' now"):
        previous_rows(out, {**now, "device": "H100"}, ("settings.shape",), "name", ["unified"])
    assert json.loads(out.read_text())["results"] == rows  # refused: the file is as it was


def test_mismatch_by_position_averages_each_bucket_over_steps_and_seeds(tmp_path):
    """The long-completion report's plot: per setting, the mean of each position bucket's logged mismatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plot_results import mismatch_by_position, plot_mismatch_by_position

    def run(setting, seed, values):
        steps = [{"step": i + 1, "reward": 0.5, **{f"fp8/mismatch/pos_{lo}_{hi}/{stat}": v for (lo, hi), v in zip(
            [(0, 63), (64, 127), (512, 1023)], row, strict=False) for stat in ("abs_logp_diff_mean", "kl_k3")}}
            for i, row in enumerate(values)]  # fmt: skip
        return {"setting": {"name": setting}, "args": {"seed": seed}, "steps": steps, "device": "cpu"}

    runs = [run("fp8", 0, [[0.1, 0.2, 0.4], [0.3, 0.2]]), run("fp8", 1, [[0.2, 0.2, 0.6]]), run("bf16", 0, [[0.01]])]
    table = mismatch_by_position(runs)
    assert table["fp8"] == pytest.approx({0: 0.2, 64: 0.2, 512: 0.5}) and table["bf16"] == {0: 0.01}
    assert plot_mismatch_by_position(runs, tmp_path, plt, "convergence_x").exists()
    assert plot_mismatch_by_position([run("bf16", 0, [])], tmp_path, plt, "x") is None  # nothing logged: no plot


def test_parallel_runs_get_their_own_seed_and_results_folder():
    """`run_grpo.py --parallel --seeds 0 1` passes each run one `--seed` and `--results_dir`, never the parent's."""
    from benchmarks.convergence.run_grpo import strip_option

    argv = ["--task", "trace", "--seeds", "0", "1", "--results_dir", "/r", "--seed", "3", "--steps", "5"]
    assert strip_option(strip_option(strip_option(argv, "--seeds"), "--seed"), "--results_dir") == [
        "--task", "trace", "--steps", "5"]  # fmt: skip
    from benchmarks.convergence.run_grpo import chosen_settings, seed_results_dir

    assert chosen_settings(["fp8_tis", "fp8_tis_fp8kv", "fp8_tis"]) == ["fp8_tis", "fp8_tis_fp8kv"]
    assert len(chosen_settings(["all"])) == 6 and chosen_settings(["bf16"]) == ["bf16"]

    # a seed's folder does not depend on which seeds ran beside it (seed 1 alone, in a later lease, still gets _seed1)
    assert [seed_results_dir("/r/c", s) for s in (0, 1, 2)] == ["/r/c", "/r/c_seed1", "/r/c_seed2"]


def test_every_setting_builds_its_config_with_a_rollout_kernel_named(monkeypatch, tmp_path):
    """`--vllm_fp8_backend cutlass` reaches only the settings with our block-FP8 rollouts: the BF16 and vLLM-online
    settings refuse a kernel choice, and a GPU lease once lost its first launch to that refusal."""
    import argparse

    import trl_fp8.config
    from benchmarks.convergence.pretrain import load_task
    from benchmarks.convergence.run_grpo import EXACT, STUDY, grpo_config

    monkeypatch.setattr(trl_fp8.config, "check_vllm_version", lambda: "0.26.0")  # no vLLM on the CPU host
    args = argparse.Namespace(workdir=str(tmp_path), seed=0, steps=4, lr=1e-5, batch_size=64, micro_batch=8,
                              num_generations=8, gradient_checkpointing=True, no_vllm=False, vllm_memory=0.05,
                              vllm_fp8_backend="cutlass", completion_len=None, ignore_eos=False)  # fmt: skip
    configs = {s: grpo_config(args, s, load_task("chain"), cuda=False) for s in STUDY}
    assert {s: c.vllm_fp8_backend for s, c in configs.items()} == {
        "bf16": "auto", "bf16_fp8rollout": "auto", "bf16_fp8rollout_tis": "auto", "fp8": "cutlass",
        "fp8_tis": "cutlass", "fp8_tis_fp8kv": "cutlass"}  # fmt: skip
    assert [s for s, c in configs.items() if c.fp8_kv_cache] == ["fp8_tis_fp8kv"]
    assert {c.gradient_accumulation_steps for c in configs.values()} == {8}
    assert not any(c.exact_on_policy or c.generation_kwargs for c in configs.values())
    # the exact settings: exact mode, long completions that ignore the end of sequence; a kernel exact mode cannot
    # run is refused by the config, naming the fix
    with pytest.raises(ValueError, match="vllm_fp8_backend 'auto' or 'deepgemm'"):
        grpo_config(args, "fp8_exact", load_task("chain"), cuda=False)
    args.vllm_fp8_backend, args.completion_len, args.ignore_eos = "auto", 512, True
    exact = {s: grpo_config(args, s, load_task("chain"), cuda=False) for s in EXACT}
    assert all(c.exact_on_policy and c.max_completion_length == 512 for c in exact.values())
    assert all(c.generation_kwargs["ignore_eos"] is True for c in exact.values())
    assert [s for s, c in exact.items() if c.fp8_kv_cache] == ["fp8_exact_fp8kv"]


def test_run_grpo_context_copy_links_the_weights_and_raises_the_positions(tmp_path):
    """`--context`: the trained weights, linked, under a config allowing the longer sequences; the folder as it was
    when it already allows them."""
    from benchmarks.convergence.run_grpo import with_context

    model = tmp_path / "arith"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 128, "hidden_size": 768}))
    (model / "model.safetensors").write_bytes(b"weights")
    assert with_context(str(model), None, tmp_path) == str(model)
    assert with_context(str(model), 128, tmp_path) == str(model)
    longer = Path(with_context(str(model), 640, tmp_path / "work"))
    assert json.loads((longer / "config.json").read_text()) == {"max_position_embeddings": 640, "hidden_size": 768}
    assert (longer / "model.safetensors").is_symlink() and (longer / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 128  # the original kept
    assert with_context(str(model), 640, tmp_path / "work") == str(longer)  # again: the same folder


def test_parallel_seeds_spread_over_gpus_one_seed_per_gpu():
    from benchmarks.convergence.run_grpo import gpu_of_seed

    assert gpu_of_seed([0, 1], [0, 1]) == {0: "0", 1: "1"}
    assert gpu_of_seed([0, 1, 2], [3]) == {0: "3", 1: "3", 2: "3"}
    assert gpu_of_seed([0, 1], None) == {0: None, 1: None}


def test_parallel_runs_each_get_their_own_rendezvous_port():
    """Two GPUs' start-up queues once picked port 29500 at the same moment: every run now has a port of its own."""
    from benchmarks.convergence.run_grpo import SETTINGS, gpu_of_seed, run_env

    gpu = gpu_of_seed([0, 1], [0, 1])
    seeds = [seed for seed in (0, 1) for _ in SETTINGS]  # the runs in run_parallel's order
    envs = [run_env(i, gpu[seed]) for i, seed in enumerate(seeds)]
    assert len({e["MASTER_PORT"] for e in envs}) == len(envs) == 2 * len(SETTINGS)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0"] * len(SETTINGS) + ["1"] * len(SETTINGS)
    assert "CUDA_VISIBLE_DEVICES" not in run_env(0, None)


def test_parallel_runs_train_once_all_started_or_failed(tmp_path, capsys):
    """A run that fails to start no longer stops the others: they train once every run is ready or marked failed,
    and give up only if some run neither starts nor fails in time."""
    from benchmarks.convergence.run_grpo import wait_for_all

    (tmp_path / "bf16_seed0.ready").touch()
    (tmp_path / "fp8_seed1.failed").touch()
    wait_for_all(tmp_path, "fp8_seed0", 3)
    assert "fp8_seed0: training without ['fp8_seed1'], which failed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="1 parallel runs never started"):
        wait_for_all(tmp_path, "fp8_tis_seed0", 5, timeout_s=0)


def test_parallel_runs_stop_level_at_the_deadline(tmp_path):
    """The first run past `--max_minutes` fixes the stop step for all: one behind trains on to it, one ahead stops at
    once; a run lagging past the grace period stops where it is."""
    from benchmarks.convergence.run_grpo import Deadline

    first, behind, ahead, lagging = (Deadline(1e-6, tmp_path, grace_s=g) for g in (60, 60, 60, 0))
    assert not Deadline(None, tmp_path).reached(100)  # no --max_minutes: never
    past, later = Deadline(None, None, stop_at=time.time() - 1), Deadline(60, None, stop_at=time.time() - 1)
    for d in (past, later):  # --stop_at alone, or sooner than --max_minutes: it ends training
        d.start()
        assert d.reached(3) and d.stopped_at == 3
    sooner = Deadline(1e-6, None, stop_at=time.time() + 3600)
    sooner.start()
    time.sleep(0.01)
    assert sooner.reached(1)  # --max_minutes sooner than --stop_at
    for deadline in (first, behind, ahead, lagging):
        assert not deadline.reached(1)  # not started: training has not begun
        deadline.start()
    time.sleep(0.01)
    assert first.reached(5) and (tmp_path / "stop").read_text() == "5" and first.stopped_at == 5
    assert not behind.reached(4) and behind.reached(5) and behind.stopped_at == 5
    assert ahead.reached(7) and ahead.stopped_at == 7
    assert lagging.reached(2) and lagging.stopped_at == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stop"]  # the per-process temporary link source is gone


def test_speed_regimes_and_long_task_runs_get_their_own_tables_and_plots(tmp_path):
    """`grpo_speed_<device>.json` (64 x 1k), `grpo_speed_four_<device>.json` and `grpo_speed_long_<device>.json`
    each get a table and a plot (a dated file is an earlier run, left out); a long-completion task's runs get the
    accuracy-and-mismatch table; the rollout plot draws `rollout_<device>.json`, and the long regime's profiled
    rollouts get a table whose kernel categories are recomputed from the recorded kernels."""
    import matplotlib

    matplotlib.use("Agg")
    from benchmarks.plot_results import main as plot_results
    from benchmarks.plot_results import rollout_result, speed_results, tables

    def speed(completion_len, step_s):
        rows = [{"name": name, "step_time": {"step_s": t, "rollout_s": t / 2, "training_s": t / 2, "weight_sync_s": 0.0}}
                for name, t in (("trl_bf16", step_s), ("unified", step_s / 2))]  # fmt: skip
        settings = {"shape": "1.7b", "generation_batch": 128, "completion_len": completion_len}
        return json.dumps({"settings": settings, "results": rows, "device": "cpu", "date": "today"})

    (tmp_path / "grpo_speed_cpu.json").write_text(speed(1024, 10.0))
    (tmp_path / "grpo_speed_cpu_2026-01-01.json").write_text(speed(1024, 99.0))
    (tmp_path / "grpo_speed_long_cpu.json").write_text(speed(4096, 40.0))
    (tmp_path / "grpo_speed_four_cpu.json").write_text(speed(1024, 30.0))
    found = speed_results(tmp_path)
    assert [stem for stem, _ in found] == ["grpo_step_time", "grpo_step_time_four", "grpo_step_time_long"]
    assert [r["results"][0]["step_time"]["step_s"] for _, r in found] == [10.0, 30.0, 40.0]
    chain = tmp_path / "convergence_chain"
    chain.mkdir()
    steps = [{"step": 1, "reward": 0.25, "fp8/mismatch/pos_0_63/abs_logp_diff_mean": 0.001,
              "fp8/mismatch/pos_512_1023/abs_logp_diff_mean": 0.004}]  # fmt: skip
    run = {"setting": {"name": "fp8"}, "args": {"seed": 0, "task": "chain", "eval_problems": 256}, "steps": steps,
           "held_out": [{"step": 0, "held_out_accuracy": 0.3}, {"step": 1, "held_out_accuracy": 0.35}],
           "device": "cpu"}  # fmt: skip
    (chain / "grpo_fp8_cpu.json").write_text(json.dumps(run))
    (tmp_path / "convergence_chain_seed1").mkdir()  # a second seed that evaluated one step further
    later = {
        **run,
        "args": {**run["args"], "seed": 1},
        "held_out": [*run["held_out"], {"step": 2, "held_out_accuracy": 0.4}],
    }
    (tmp_path / "convergence_chain_seed1" / "grpo_fp8_cpu.json").write_text(json.dumps(later))

    def rollout(engine, tokens_per_s, profile=None):
        point = {"seqs": 128, "new_tokens": 4096, "tokens_per_s": tokens_per_s, "of_floor": 0.5}
        return {"engine": engine, "points": [point], **({"profile": profile} if profile else {})}

    def profile(kernels):  # as bench_rollout records it: the file's own categories, and the heaviest kernels
        return {"seqs": 128, "new_tokens": 1024, "attention_kv_floor_ms": 1000.0,
                "kernel_ms_by_category": {"stale": sum(kernels.values())},
                "top_kernels": [{"name": name, "ms": ms, "count": 1} for name, ms in kernels.items()]}  # fmt: skip

    shape = {"name": "1.7b"}
    (tmp_path / "rollout_cpu.json").write_text(
        json.dumps({"device": "cpu", "shape": shape, "results": [rollout("bf16", 100.0)]})
    )
    bf16 = profile({"flash_fwd_kernel": 3000.0, "nvjet_sm90_tst_192x64": 1000.0})
    fp8 = profile({"flash_fwd_kernel": 3000.0, "cutlass_3x_gemm_fp8_blockwise": 1500.0,
                   "silu_and_mul_per_block_quant_kernel": 400.0, "unknown": 100.0})  # fmt: skip
    long = [rollout("bf16", 100.0, bf16), rollout("fp8_cutlass", 90.0, fp8)]
    (tmp_path / "rollout_long_cpu.json").write_text(json.dumps({"device": "cpu", "shape": shape, "results": long}))
    assert rollout_result(tmp_path)["results"] == [rollout("bf16", 100.0)]
    text = tables(tmp_path)
    assert "| engine | tokens/s | vs bf16 | of floor | kernels | attention | gemm, fp8 | gemm, bf16 |" in text
    assert "| fp8_cutlass | 90 | 0.90x | 50% | 5.00 | 3.00 (1.00) | 1.50 | - | 0.40 | 0.10 | 100.0% |" in text
    assert "| bf16 | 100 | 1.00x | 50% | 4.00 | 3.00 (1.00) | - | 1.00 | - | - | 100.0% |" in text
    assert "1.7b shape, 128 x 1024 tokens" in text and "1.7b shape, 128 x 4096 tokens" in text
    assert "| unified | 5.00 |" in text and "| unified | 20.00 |" in text and "99.00" not in text
    assert "| unified | 15.00 |" in text  # the four flows at 64 x 1k: a table of their own
    assert "| fp8 | 0 | 30.00 | 35.00 | 1 | 35.00 | 0.250 | 1.00e-03 | 4.00e-03 (from 512) |" in text
    assert "| fp8 | 1 | 30.00 | 35.00 | 2 | 40.00 |" in text  # step 1: the last step both seeds evaluated
    assert "| fp8 | 1.00e-03 | 4.00e-03 | 4.0x |" in text  # the per-bucket table: from 0, from 512, last / first
    names = {p.name for p in plot_results(["--results", str(tmp_path), "--out", str(tmp_path / "plots")])}
    assert {"grpo_step_time.png", "grpo_step_time_four.png", "grpo_step_time_long.png",
            "convergence_chain_mismatch_by_position.png", "rollout_throughput.png"} <= names  # fmt: skip


def test_training_phase_and_host_benchmarks_run_at_smoke_size(tmp_path):
    """bench_train_step on CPU: BF16 and the FP8 flows train the same tiny model on the same batches (learning rate
    0), so their losses agree to FP8 noise; a flow that cannot run here (Liger: GPU kernels, maybe not installed)
    is recorded with its error and the others go on. Each flow runs in a process of its own (Liger patches the model
    type module-wide: a later flow in the same process would run its kernels). bench_host times every piece that
    runs without CUDA."""
    _run("benchmarks.bench_train_step", "--shape", "tiny", "--quick",
         "--flows", "bf16", "fp8", "fp8_fused", "fp8_ckpt2", "fp8_nockpt", "fp8_liger", "--profile", tmp_path / "prof", "--out", tmp_path / "ts.json",
         profiler_crash_retry=True)  # fmt: skip
    rows = {r["flow"]: r for r in json.loads((tmp_path / "ts.json").read_text())["results"]}
    assert "error" in rows["fp8_liger"] or rows["fp8_liger"]["step_s"] > 0
    for flow in ("bf16", "fp8", "fp8_fused"):
        assert rows[flow]["step_s"] > 0 and rows[flow]["profile"]["wall_ms"] > 0
        assert abs(rows[flow]["loss"] - rows["bf16"]["loss"]) < 0.02 * rows["bf16"]["loss"]
    assert rows["fp8"]["loss"] != rows["bf16"]["loss"]  # the FP8 flow did run in FP8
    # FP8's own ratio: each FP8 flow against the BF16 flow with the same kernels, checkpointing and compilation
    assert rows["fp8"]["bf16_twin"] == rows["fp8_fused"]["bf16_twin"] == "bf16"
    assert rows["fp8"]["vs_bf16_twin"] == rows["bf16"]["step_s"] / rows["fp8"]["step_s"]
    assert "bf16_twin" not in rows["bf16"] and "bf16_twin" not in rows["fp8_nockpt"]  # (its twin did not run)
    pids = [r["pid"] for r in rows.values() if "pid" in r]
    assert len(pids) >= 4 and len(set(pids)) == len(pids)

    # The fusions and the checkpointing choices compute the same FP8 operands, so the same loss, up to the emulated
    # fp32 GEMMs' summation order: each flow runs in a process of its own, and a CPU BLAS is not bitwise reproducible
    # across processes (its kernel path can follow a buffer's alignment, or a stacked weight's shape), which can flip a
    # BF16 rounding of an output. Bound: one BF16 ulp of the loss (a wrong slice of a stacked GEMM, or a recompute
    # on other inputs, would move it by far more).
    def same_loss(flow):
        return abs(rows[flow]["loss"] - rows["fp8"]["loss"]) <= 2**-8 * abs(rows["fp8"]["loss"])

    assert same_loss("fp8_fused") and same_loss("fp8_nockpt")
    # (transformers before `every_n_layers` records that it lacks it)
    assert "activation_checkpointing_enable" in rows["fp8_ckpt2"].get("error", "") or same_loss("fp8_ckpt2")
    _run("benchmarks.bench_host", "--quick", "--profile", tmp_path / "host_prof", "--out", tmp_path / "host.json",
         profiler_crash_retry=True)  # fmt: skip
    rows = {r["case"]: r for r in json.loads((tmp_path / "host.json").read_text())["results"]}
    profiled = {"nn.Linear fwd+bwd", "FP8Linear fwd+bwd (cached W)", "3 x FP8Linear as one sibling GEMM fwd+bwd"}
    assert profiled <= set(rows) and all(r["host_us"] > 0 for r in rows.values())
    # the profiled rows name their ops: an FP8 layer issues more of them than nn.Linear (its quantizers at least)
    ops = {case: rows[case]["host_ops"] for case in profiled}
    assert ops["FP8Linear fwd+bwd (cached W)"]["ops_per_call"] > ops["nn.Linear fwd+bwd"]["ops_per_call"] > 0
    assert any(o["name"] == "aten::mm" for o in ops["nn.Linear fwd+bwd"]["ops"])
    assert len(list((tmp_path / "host_prof").glob("*.txt"))) == 3


def test_experts_benchmark_runs_at_smoke_size(tmp_path):
    """bench_experts on CPU at a tiny MoE shape: BF16 and FP8 experts run forward + backward on the same routing, and
    the FP8 output stays within FP8 noise of BF16's (two chained FP8 GEMMs: ~0.06, `test_fp8_experts.py`)."""
    _run("benchmarks.bench_experts", "--quick", "--out", tmp_path / "experts.json")
    (row,) = json.loads((tmp_path / "experts.json").read_text())["results"]
    assert row["bf16_ms"] > 0 and row["fp8_ms"] > 0 and row["experts_with_tokens"] > 1
    assert row["fp8_autograd_add_ms"] > 0 and row["fp8_no_cache_in_training_ms"] > 0
    assert row["fp8_fprop_dgrad_kernel"] == "emulation"
    assert 0 < row["fp8_rel_err_vs_bf16"] < 0.15


def test_grouped_gemm_benchmark_runs_at_smoke_size(tmp_path):
    """bench_grouped_gemm on CPU (Triton's interpreter) at a tiny MoE shape: each projection's FP8 fwd+bwd and every
    kernel of it timed, the padded rows covering the routed ones."""
    pytest.importorskip("triton")
    _run("benchmarks.bench_grouped_gemm", "--quick", "--out", tmp_path / "gg.json")
    (row,) = json.loads((tmp_path / "gg.json").read_text())["results"]
    assert [p["projection"] for p in row["projections"]] == ["gate_up", "down"]
    assert all(p["fp8_triton_ms"] > 0 for p in row["projections"])
    kernels = {k["kernel"] for k in row["kernels"]["down"]}
    assert {"triton m_grouped FProp", "triton m_grouped DGrad", "k_grouped WGrad", "transpose_expert_weights (DGrad, "
            "cached)", "triton m_grouped DGrad, row-major blocks (strided)"} <= kernels  # fmt: skip
    (strided,) = [k for k in row["kernels"]["down"] if k["kernel"] == "strided vs transposed triton dgrad"]
    assert strided["max_rel_diff"] < 1e-5  # the same FP8 operands, read through other strides


def test_decode_attention_benchmark_runs_its_reference_and_floors_on_cpu(tmp_path):
    """bench_decode_attention on CPU (no CUDA, no vLLM): every kernel skipped with the reason, the float32 reference
    checked against scaled_dot_product_attention, and each row's floor the bytes its shapes give over the H200's HBM
    bandwidth (the one assumed without a known GPU)."""
    out = _run("benchmarks.bench_decode_attention", "--quick", "--seqs", 3, "--context", 40, 64, "--max_model_len",
               128, "--out", tmp_path / "decode.json")  # fmt: skip
    result = json.loads((tmp_path / "decode.json").read_text())
    assert result["device"] == "cpu" and result["date"] and result["command"].startswith("python -m benchmarks.")
    assert result["versions"]["torch"] and {"vllm", "flashinfer-python"} <= set(result["versions"])
    assert result["shapes"] == {"seqs": 3, "contexts": [40, 64], "q_heads": 8, "kv_heads": 2, "head_dim": 64,
                                "block_size": 16, "layers": 2, "kv_layout": "packed",
                                "max_model_len": 128}  # fmt: skip
    assert result["hbm_bytes_per_s"] == 4.8e12 and result["err_bound_of_max_ref"] == 2**-3
    assert [r["context"] for r in result["reference"]] == [40, 64]
    assert all(r["self_check_max_diff"] < 1e-5 * r["max_ref"] for r in result["reference"])
    per_element = {
        "fa3_bf16": (2, 2),
        "fa3_fp8": (1, 1),
        "triton_fp8": (1, 1),
        "xqa_fp8": (1, 2),
        "xqa_fp8_tensor_scales": (1, 2),
        "xqa_fp8_live_scales": (1, 2),
    }  # (K/V bytes, query bytes), fmt: skip
    assert set(result["kernels"]) == set(per_element)
    assert [(r["kernel"], r["context"]) for r in result["results"]] == [(k, n) for n in (40, 64) for k in per_element]
    for row in result["results"]:
        kv, q = per_element[row["kernel"]]
        # 3 sequences x context tokens x 2 KV heads x 64 dims, K and V; the query read and the BF16 output written
        expected = 3 * row["context"] * 2 * 64 * 2 * kv + 3 * 8 * 64 * (q + 2)
        assert row["bytes"] == expected and row["floor_us"] == pytest.approx(expected / 4.8e12 * 1e6)
        assert row["skipped"].startswith("no CUDA device") and "us" not in row
    assert "skipped: no CUDA device" in out and "floor, FP8 cache" in out and "FAILED" not in out


def test_decode_attention_table_says_failed_only_where_a_check_failed(capsys):
    from benchmarks import bench_decode_attention as bench

    shapes = {"seqs": 128, "contexts": [1024], "q_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16,
              "layers": 20, "kv_layout": "packed"}  # fmt: skip
    row = {"kernel": "xqa_fp8", "context": 1024, "us": 75.0, "fraction": 0.75, "max_err": 0.01, "max_ref": 0.3,
           "check": "ok"}  # fmt: skip
    result = {
        "shapes": shapes,
        "device": "NVIDIA H200",
        "hbm_bytes_per_s": 4.8e12,
        "hbm_source": "data sheet",
        "timing": {"repeats": 20},
        "results": [row],
        "reference": [],
        "kernels": {"xqa_fp8": {"label": "XQA"}},
    }
    bench.print_table(result, ["xqa_fp8"])
    assert "FAILED" not in capsys.readouterr().out
    row["check"] = "FAILED"
    bench.print_table(result, ["xqa_fp8"])
    table = capsys.readouterr().out
    assert "the output's check failed" in table and "(75% of floor) FAILED" in table


def test_decode_attention_reference_reads_each_sequences_tokens_through_its_shuffled_pages():
    """The reference the GPU kernels are checked against: sequences written token by token into pages taken from a
    shuffled pool (both cache layouts) give the attention of the contiguous sequences; a block table whose rows are
    shifted by one sequence does not. The floor at the benchmark's 8B shape: 512 MiB of FP8 K and V at 2,048 tokens
    plus 2 MiB of BF16 query and output (XQA's), 112.3 us at 4.8 TB/s."""
    import torch
    import torch.nn.functional as F

    from benchmarks import bench_decode_attention as bench

    shape = bench.Shape(seqs=3, q_heads=8, kv_heads=2, head_dim=32, block_size=16)
    context, scales = 37, {"q": 0.02, "k": 0.02, "v": 0.015}  # the last page partly used
    torch.manual_seed(0)
    k_seq, v_seq = torch.randn(2, shape.seqs, context, shape.kv_heads, shape.head_dim)
    q = torch.randn(shape.seqs, shape.q_heads, shape.head_dim).to(torch.bfloat16)
    for layout in ("packed", "separate"):
        batch = bench.make_batch(shape, context, 1, scales, layout, seed=1, device=torch.device("cpu"))
        _, k8, v8 = batch.fp8[0]
        for s in range(shape.seqs):
            for t in range(context):
                page, slot = batch.block_table[s, t // shape.block_size], t % shape.block_size
                k8[page, slot] = (k_seq[s, t] / scales["k"]).to(bench.FP8)
                v8[page, slot] = (v_seq[s, t] / scales["v"]).to(bench.FP8)
        # the contiguous sequences, rounded as the cache holds them
        k = (k_seq / scales["k"]).to(bench.FP8).float() * scales["k"]
        v = (v_seq / scales["v"]).to(bench.FP8).float() * scales["v"]
        expected = F.scaled_dot_product_attention(q.float()[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                                  enable_gqa=True)[:, :, 0]  # fmt: skip
        ref = bench.reference_attention(q, k8, v8, batch.block_table, context, scales["k"], scales["v"])
        torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-6)
        shifted = batch.block_table.roll(1, dims=0)  # each sequence's query over its neighbour's pages
        wrong = bench.reference_attention(q, k8, v8, shifted, context, scales["k"], scales["v"])
        assert (wrong - expected).abs().max() > 0.1 * expected.abs().max()

    full = bench.Shape(seqs=128, q_heads=32, kv_heads=8, head_dim=128, block_size=16)
    fp8 = bench.decode_bytes(full, 2048, kv_bytes=1, q_bytes=2)
    assert fp8 == {"kv": 512 * 2**20, "query_output": 2 * 2**20, "total": 514 * 2**20}
    assert bench.floor_us(fp8["total"], 4.8e12) == pytest.approx(112.28, abs=0.01)
    assert bench.decode_bytes(full, 2048, kv_bytes=2, q_bytes=2)["kv"] == 2**30
    assert [bench.triton_seq_threshold_3d(kv) for kv in (8, 4, 1, 3)] == [16, 32, 128, 40]  # 128 // 3 = 42 -> 40


def test_moe_decode_benchmark_runs_its_reference_and_floors_on_cpu(tmp_path):
    """bench_moe_decode on CPU (no CUDA, no vLLM): every variant skipped with the reason, the float32 reference
    checked against a token-by-token loop, and each row's floor the bytes of the experts its routing hits over the
    H200's HBM bandwidth (the one assumed without a known GPU)."""
    out = _run("benchmarks.bench_moe_decode", "--quick", "--tokens", 3, 8, "--out", tmp_path / "moe.json")
    result = json.loads((tmp_path / "moe.json").read_text())
    assert result["device"] == "cpu" and result["date"] and result["command"].startswith("python -m benchmarks.")
    assert result["versions"]["torch"] and {"vllm", "triton", "deep_gemm (bundled)"} <= set(result["versions"])
    assert result["shapes"] == {"hidden": 256, "intermediate": 128, "experts": 16, "top_k": 4, "tokens": [3, 8],
                                "layers": 2, "block": 128, "weight_std": 0.02}  # fmt: skip
    assert result["hbm_bytes_per_s"] == 4.8e12 and result["err_bound_of_max_ref"] == {"bf16": 2**-5, "fp8": 2**-3}
    variants = {"bf16": "bf16", "fp8_block_triton": "fp8", "fp8_block_triton_trl_act_quant": "fp8",
                "fp8_block_deepgemm": "fp8"}  # fmt: skip
    assert list(result["variants"]) == list(variants) and "parts" not in result
    # one expert: w13 [256 x 256] and w2 [256 x 128], 98,304 weights: 2 bytes each in BF16; 1 in FP8, plus a float32
    # scale per 128x128 block (2 x 2 of w13, 2 x 1 of w2)
    per_expert = {"bf16": 196_608, "fp8": 98_304 + 6 * 4}
    assert all(v["expert_bytes"]["total"] == per_expert[v["dtype"]] for v in result["variants"].values())
    routing = {r["tokens"]: r for r in result["routing"]}
    assert set(routing) == {3, 8}
    for n, r in routing.items():
        assert 4 <= r["experts_hit"] <= min(16, 4 * n) and 1 <= r["max_expert_load"] <= n
        for dtype in ("bf16", "fp8"):
            assert r[f"floor_us_{dtype}"] == pytest.approx(r["experts_hit"] * per_expert[dtype] / 4.8e12 * 1e6)
    assert [(r["variant"], r["tokens"]) for r in result["results"]] == [(v, n) for n in (3, 8) for v in variants]
    for row in result["results"]:
        dtype = variants[row["variant"]]
        assert row["experts_hit"] == routing[row["tokens"]]["experts_hit"]
        assert row["bytes"] == row["experts_hit"] * per_expert[dtype]
        assert row["floor_us"] == pytest.approx(row["bytes"] / 4.8e12 * 1e6)
        assert row["err_bound"] == pytest.approx(result["err_bound_of_max_ref"][dtype] * row["max_ref"])
        assert row["skipped"].startswith("no CUDA device") and "us" not in row
    for r in result["reference"]:
        assert r["self_check_max_diff"] < 1e-5 * r["max_ref_bf16"]
        # FP8's roundings show, and stay within a few percent of the output
        assert 0 < r["fp8_vs_bf16_max_diff"] < 0.2 * r["max_ref_bf16"]
    assert "skipped: no CUDA device" in out and "floor, FP8 weights + scales" in out and "FAILED" not in out
    assert "python -m benchmarks.bench_moe_decode" in report_phase("moeexperts")  # the GPU host's phase


def test_moe_decode_floor_counts_the_routed_experts_and_the_reference_quantizes_as_vllm():
    """The floor at Qwen3-30B-A3B's shape (9.4 MB an expert in BF16, 4.7 MB in FP8 with its scales: 252 us and 126 us
    at 4.8 TB/s once all 128 experts are hit), the routing, and the FP8 roundings of the reference: 128x128 weight
    blocks and 1x128 activation groups scaled by amax / 448 (vLLM's `per_token_group_quant_fp8`)."""
    import torch

    from benchmarks import bench_moe_decode as bench

    full = bench.Shape(hidden=2048, intermediate=768, experts=128, top_k=8)
    assert bench.expert_bytes(full, "bf16") == {"w13": 6_291_456, "w2": 3_145_728, "scales": 0, "total": 9_437_184}
    assert bench.expert_bytes(full, "fp8") == {"w13": 3_145_728 + 12 * 16 * 4, "w2": 1_572_864 + 16 * 6 * 4,
                                               "scales": 1152, "total": 4_719_744}  # fmt: skip
    assert bench.floor_us(128 * 9_437_184, 4.8e12) == pytest.approx(251.66, abs=0.01)
    assert bench.floor_us(128 * 4_719_744, 4.8e12) == pytest.approx(125.86, abs=0.01)
    assert bench.experts_hit(torch.tensor([[0, 5], [5, 7]], dtype=torch.int32)) == 3

    gen = torch.Generator().manual_seed(0)
    weights, ids = bench.route(64, full, gen, "cpu")
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == weights.shape == (64, 8)
    assert torch.allclose(weights.sum(-1), torch.ones(64)) and all(len(set(row.tolist())) == 8 for row in ids)
    assert bench.experts_hit(ids) > 100  # 64 tokens x 8 of 128 experts: nearly every expert

    w = torch.randn(2, 256, 384, generator=gen) * 0.02
    q, scale = bench.quantize_blocks(w)
    assert q.dtype == bench.FP8 and scale.shape == (2, 2, 3)
    blocks = w.reshape(2, 2, 128, 3, 128)
    torch.testing.assert_close(scale, blocks.abs().amax(dim=(2, 4)) / 448)
    back = bench.dequantize_blocks(q, scale)
    assert (back - w).abs().max() <= 2**-4 * w.abs().max()  # half an e4m3 ulp of the block's largest value at most
    assert torch.equal(back.reshape(2, 2, 128, 3, 128).abs().amax(dim=(2, 4)), blocks.abs().amax(dim=(2, 4)))

    x = torch.randn(3, 256, generator=gen)
    x[1, :128] = 0.0  # a zero group: scale 1e-10 / 448, zero values
    q, scale = bench.quantize_groups(x)
    assert scale.shape == (3, 2) and scale[1, 0] == pytest.approx(1e-10 / 448) and not q[1, :128].float().any()
    assert torch.equal(q.float().unflatten(-1, (2, 128)).abs().amax(-1)[scale > 1e-9], torch.full((5,), 448.0))

    # one token routed with weight 1 to one expert of a one-expert layer: the dense gated MLP
    tiny = bench.Shape(hidden=128, intermediate=128, experts=1, top_k=1)
    layer = bench.make_layer(tiny, gen, "cpu")
    xb = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    one, zero = torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    h = xb.float() @ layer.w13[0].float().T
    dense = (torch.nn.functional.silu(h[:, :128]) * h[:, 128:]) @ layer.w2[0].float().T
    torch.testing.assert_close(bench.reference_moe(xb, one, zero, layer, "bf16"), dense)


def test_moe_decode_bounds_hold_for_kernels_that_round_where_vllms_do():
    """The checks' bounds against the float32 references: an emulation of vLLM's kernels (GEMM1's output, the
    SiLU-and-mul product (BF16 only), each expert's weighted output and the sum rounded to BF16) stays well inside
    them; a routing shifted by one expert does not."""
    import torch

    from benchmarks import bench_moe_decode as bench

    shape = bench.Shape(hidden=512, intermediate=256, experts=16, top_k=4)
    gen = torch.Generator().manual_seed(1)
    layer = bench.make_layer(shape, gen, "cpu")
    weights, ids = bench.route(32, shape, gen, "cpu")
    x = torch.randn(32, shape.hidden, generator=gen).to(torch.bfloat16)
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    for dtype in ("bf16", "fp8"):
        ref = bench.reference_moe(x, weights, ids, layer, dtype)
        xf = bench.quant_dequant_groups(x.float()) if dtype == "fp8" else x.float()
        out = torch.zeros_like(ref)
        for j in range(shape.top_k):
            for e in ids[:, j].unique().tolist():
                tok = (ids[:, j] == e).nonzero().flatten()
                w13, w2 = layer.expert(e, dtype)
                h = bf(xf[tok] @ w13.T)
                a = torch.nn.functional.silu(h[:, : shape.intermediate]) * h[:, shape.intermediate :]
                a = bench.quant_dequant_groups(a) if dtype == "fp8" else bf(a)
                out[tok] += bf((a @ w2.T) * weights[tok, j, None])
        err = (bf(out) - ref).abs().max() / ref.abs().max()
        assert err < bench.ERR_BOUND[dtype] / 4, (dtype, err)
        wrong = bench.reference_moe(x, weights, (ids + 1) % shape.experts, layer, dtype)
        assert (wrong - ref).abs().max() > bench.ERR_BOUND[dtype] * ref.abs().max()


def test_moe_decode_table_says_failed_only_where_a_check_failed(capsys):
    from benchmarks import bench_moe_decode as bench

    row = {"variant": "fp8_block_triton", "tokens": 64, "us": 150.0, "fraction": 0.8, "max_err": 0.01,
           "max_ref": 0.5, "check": "ok", "time_over_bf16": 0.6}  # fmt: skip
    result = {
        "shapes": {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "tokens": [64], "layers": 12},
        "device": "NVIDIA H200",
        "hbm_bytes_per_s": 4.8e12,
        "hbm_source": "data sheet",
        "timing": {"repeats": 20},
        "routing": [{"tokens": 64, "experts_hit": 128, "floor_us_bf16": 251.7, "floor_us_fp8": 125.9}],
        "results": [row],
        "reference": [],
        "variants": {"fp8_block_triton": {"label": "Triton"}},
        "parts": [{"variant": "fp8_block_triton", "tokens": 64, "part": "gemm1", "us": 90.0, "fraction": 0.9}],
    }
    bench.print_table(result, ["fp8_block_triton"])
    table = capsys.readouterr().out
    assert "FAILED" not in table and "150.0 us (80% of floor)" in table and "0.60x" in table
    assert "fp8_block_triton: gemm1" in table and "90.0 us (90%)" in table
    row["check"] = "FAILED"
    bench.print_table(result, ["fp8_block_triton"])
    table = capsys.readouterr().out
    assert "an output's check failed" in table and "(80% of floor) FAILED" in table


def test_moe_rollout_shape_builds_its_engine_config_without_weights():
    """bench_rollout's MoE shapes: the trainer-side model lives on the meta device (no 61 GB copy), converts to FP8
    with its routers named unconverted, and the decode floor reads every expert while a token runs its top-k."""
    from benchmarks import bench_rollout
    from trl_fp8 import convert_to_fp8
    from trl_fp8.checkpoint.save import fp8_module_names
    from trl_fp8.rollout.vllm.engine import write_engine_config

    model = bench_rollout.build_trainer_model("tiny-moe")
    assert next(model.parameters()).device.type == "meta"
    convert_to_fp8(model)
    names = fp8_module_names(model)
    assert "model.layers.0.mlp.experts" in names
    import tempfile

    config = json.loads((write_engine_config(model, None, tempfile.mkdtemp(), names) / "config.json").read_text())
    assert "model.layers.0.mlp.gate" in config["quantization_config"]["modules_to_not_convert"]
    shape = bench_rollout.SHAPES["30b-a3b"]
    fp8, bf16 = (bench_rollout.model_bytes(shape, fp8_linear=f, fp8_kv=False) for f in (True, False))
    assert 30e9 < fp8["weights"] < 32e9 and 60e9 < bf16["weights"] < 62e9  # every expert's weights, + BF16 lm_head
    assert 2 * 3e9 < fp8["flops_per_token"] < 2 * 4e9  # about 3.3B active parameters per token


def test_capacity_and_colocate_results_get_their_plots(tmp_path):
    """`rollout_capacity_mem<share>_<device>.json` (one file per share; a matched-concurrency file is left out) gives
    each engine's tokens/s and floor against the share, one panel per point; `grpo_colocate_8b_<device>.json` gets
    the step-time bars and a table of its own."""
    import matplotlib

    matplotlib.use("Agg")
    from benchmarks.plot_results import capacity_series, speed_results, tables
    from benchmarks.plot_results import main as plot_results

    def capacity(share, scale, max_num_seqs=None):
        rows = [{"engine": engine, "points": [{"seqs": 256, "new_tokens": 2048, "tokens_per_s": scale * tps,
                                                "floor_tokens_per_s": 2 * scale * tps}]}
                for engine, tps in (("bf16", 100.0), ("fp8_deepgemm_kv", 250.0))]  # fmt: skip
        return json.dumps({"device": "GPU X", "gpu_memory_utilization": share, "max_num_seqs": max_num_seqs,
                           "results": rows})  # fmt: skip

    (tmp_path / "rollout_capacity_mem0.5_GPU_X.json").write_text(capacity(0.5, 2.0))
    (tmp_path / "rollout_capacity_mem0.3_GPU_X.json").write_text(capacity(0.3, 1.0))
    (tmp_path / "rollout_capacity_mem0.3_seqs22_GPU_X.json").write_text(capacity(0.3, 9.0, max_num_seqs=22))
    (tmp_path / "rollout_capacity_mem0.7_GPU_X.json").write_text(json.dumps({"device": "GPU X", "results": []}))
    series = capacity_series(tmp_path)  # the file without rows adds nothing
    assert series == {"GPU X": {"256x2048": {"bf16": [(0.3, 100.0, 200.0), (0.5, 200.0, 400.0)],
                                            "fp8_deepgemm_kv": [(0.3, 250.0, 500.0), (0.5, 500.0, 1000.0)]}}}  # fmt: skip

    step = {"step_s": 100.0, "rollout_s": 60.0, "training_s": 40.0, "weight_sync_s": 0.1}
    rows = [{"name": "unified_fp8kv", "step_time": {k: v / 2 for k, v in step.items()}},
            {"name": "trl_bf16", "step_time": step}]  # fmt: skip
    settings = {"shape": "8b", "generation_batch": 128, "completion_len": 2048, "vllm_memory": 0.3, "sleep_mode": True}
    colocate = {"settings": settings, "results": rows, "device": "GPU X", "date": "today"}
    (tmp_path / "grpo_colocate_8b_GPU_X.json").write_text(json.dumps(colocate))
    (tmp_path / "grpo_colocate_fp8_GPU_X.json").write_text("{}")  # another benchmark's file: not a step-time result
    (tmp_path / "grpo_colocate_8b_GPU_Y.json").write_text(json.dumps({**colocate, "device": "GPU Y"}))
    (tmp_path / "grpo_colocate_8b_GPU_Y_2026-01-01.json").write_text(json.dumps({**colocate, "device": "GPU Y"}))
    # one plot per GPU (an earlier, dated run of a GPU is not drawn)
    assert [stem for stem, _ in speed_results(tmp_path)] == ["grpo_colocate_step_time_GPU_X",
                                                             "grpo_colocate_step_time_GPU_Y"]  # fmt: skip
    text = tables(tmp_path)
    assert "8b shape, 128 x 2048 tokens, vLLM 0.3, sleep mode" in text
    assert "| unified_fp8kv | 50.00 | 30.00 | 20.00 | 0.05 | 2.00x / 2.00x / 2.00x |" in text
    names = {p.name for p in plot_results(["--results", str(tmp_path), "--out", str(tmp_path / "plots")])}
    assert {"rollout_capacity.png", "grpo_colocate_step_time_GPU_X.png", "grpo_colocate_step_time_GPU_Y.png"} <= names


def test_capacity_and_colocate_plots_draw_the_series_and_annotate_each_run(tmp_path):
    """The capacity plot draws one line per engine over the shares, its floor dashed beside it (a point without a
    floor is NaN, not dropped); the colocate step-time plot names the runs readably and annotates each bar with its
    step time and its speed-up over TRL BF16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as real_plt

    from benchmarks.plot_results import capacity_series, plot_capacity, plot_step_time

    figures = []

    class Plt:  # matplotlib.pyplot, keeping the figures open to read them back
        subplots = staticmethod(real_plt.subplots)

        @staticmethod
        def close(fig):
            figures.append(fig)

    for share, tps in ((0.5, 300.0), (0.3, 100.0)):
        rows = [{"engine": "fp8_deepgemm", "points": [{"seqs": 128, "new_tokens": 4096, "tokens_per_s": tps}]}]
        (tmp_path / f"rollout_capacity_mem{share}_GPU_Y.json").write_text(
            json.dumps({"device": "GPU Y", "gpu_memory_utilization": share, "results": rows})
        )
    (series,) = capacity_series(tmp_path).values()
    ((share_lo, tps_lo, floor_lo), (share_hi, tps_hi, _)) = series["128x4096"]["fp8_deepgemm"]
    assert (share_lo, tps_lo, share_hi, tps_hi) == (0.3, 100.0, 0.5, 300.0) and floor_lo != floor_lo  # NaN
    assert plot_capacity("GPU Y", series, tmp_path, Plt).name == "rollout_capacity.png"
    (ax,) = figures[-1].axes
    assert [list(line.get_ydata()) for line in ax.lines[:1]] == [[100.0, 300.0]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["FP8 weights", "floor (same colour)"]
    assert "share of the GPU" in figures[-1]._suptitle.get_text() and "GPU Y" in figures[-1]._suptitle.get_text()

    step = {"step_s": 120.0, "rollout_s": 70.0, "training_s": 50.0, "weight_sync_s": 0.1}
    rows = [{"name": "unified_fp8kv", "step_time": {k: v / 2 for k, v in step.items()}},
            {"name": "unified", "step_time": {k: v / 1.5 for k, v in step.items()}},
            {"name": "trl_bf16", "step_time": step}]  # fmt: skip
    settings = {"shape": "8b", "generation_batch": 128, "completion_len": 2048, "vllm_memory": 0.3, "sleep_mode": True}
    result = {"settings": settings, "results": rows, "device": "GPU Y", "date": "today"}
    assert plot_step_time(result, tmp_path, Plt, "grpo_colocate_step_time").exists()
    (ax,) = figures[-1].axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["TRL BF16", "unified FP8", "unified FP8\n+ FP8 KV"]
    assert [t.get_text() for t in ax.texts] == ["120.0 s, 1.00x", "80.0 s, 1.50x", "60.0 s, 2.00x"]
    plot_step_time({**result, "results": rows[:2]}, tmp_path, Plt, "grpo_step_time")  # no BF16 row: no speed-up
    (ax,) = figures[-1].axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["unified", "unified_fp8kv"]  # the bench names elsewhere
    assert [t.get_text() for t in ax.texts] == ["80.0 s", "60.0 s"]
    for fig in figures:
        real_plt.close(fig)


def test_profile_timeline_splits_a_phase_into_compute_exposed_communication_and_idle():
    """A profiled training phase under FSDP2 or DDP: NCCL's kernels are communication (not a norm, as "reduce" in
    their names would have it), the time they run while nothing computes is exposed, the time no kernel runs is idle,
    and what the phase left out of the profile (the rollout inside a step, between the markers) is not idle."""
    from types import SimpleNamespace

    import torch

    from benchmarks.common import (
        SEGMENT_END,
        UNTRACED_BEGIN,
        UNTRACED_END,
        kernel_breakdown,
        kernel_category,
        kernel_timeline,
    )

    assert kernel_category("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "communication (NCCL)"
    )
    assert kernel_category("_rms_norm_forward_kernel") == "norms / reductions"
    gemm, rs, ag = "deep_gemm::fp8_gemm_kernel", "ncclDevKernel_ReduceScatter_Sum", "ncclDevKernel_AllGather_RING"
    # us: compute 0-100 and 150-250; a gather hidden under compute (20-60), a reduction half exposed (230-280);
    # nothing at 100-150 (idle) and 280-300 (idle); a rollout left out at 300-1300; compute again 1300-1400.
    kernels = [(gemm, 0, 100), (ag, 20, 60), (gemm, 150, 250), (rs, 230, 280), (gemm, 300, 300.5),
               (gemm, 1300, 1400)]  # fmt: skip
    timeline = kernel_timeline(kernels, untraced=[(300.5, 1300)])
    assert timeline["span_ms"] == pytest.approx((1400 - 999.5) / 1e3)
    assert timeline["compute_busy_ms"] == pytest.approx(300.5 / 1e3)
    assert timeline["nccl_busy_ms"] == pytest.approx(90 / 1e3)
    assert timeline["nccl_exposed_ms"] == pytest.approx(30 / 1e3)
    assert timeline["idle_ms"] == pytest.approx((400.5 - 300.5 - 30) / 1e3)

    def event(name, start, end, device=torch.autograd.DeviceType.CUDA, annotation=False):
        return SimpleNamespace(key=name, name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               self_device_time_total=end - start, count=1, is_user_annotation=annotation)  # fmt: skip

    cpu = torch.autograd.DeviceType.CPU
    events = [event(*k) for k in kernels] + [
        event(UNTRACED_BEGIN, 300.5, 300.6, cpu, annotation=True),
        event(UNTRACED_END, 1299, 1300, cpu, annotation=True),
        event("llm_engine step: get_output", 0, 120, cpu, annotation=True),  # vLLM's host steps, twice
        event("llm_engine step: get_output", 140, 160, cpu, annotation=True),
        event("aten::mm", 10, 20, cpu),  # an operator, not a scope
        # c10d's GPU-side annotation around its gather: it spans the NCCL kernel and is not a kernel of its own
        event("nccl:_all_gather_base", 20, 60, annotation=True),
        event("nccl:_all_gather_base", 100, 150, annotation=True),  # (one over the idle gap would hide it)
    ]
    prof = SimpleNamespace(key_averages=lambda: [e for e in events if e.device_type != cpu], events=lambda: events)
    breakdown = kernel_breakdown(prof)
    assert breakdown["timeline"] == pytest.approx(timeline)
    assert breakdown["kernel_ms_by_category"]["communication (NCCL)"] == pytest.approx(90 / 1e3)
    assert "timeline_parts" not in breakdown
    nccl = breakdown["nccl_kernels"]  # the gather (40 us, from 20) and the reduction (50 us, from 230)
    assert nccl["count"] == 2 and nccl["p10_ms"] == pytest.approx(0.04) and nccl["p90_ms"] == pytest.approx(0.05)
    assert [k["at_ms"] for k in nccl["longest"]] == pytest.approx([0.23, 0.02])
    # the idle gaps (100-150 and 280-300 us; the part left out is not one) and the host's named steps
    gaps = breakdown["idle_gaps"]
    assert gaps["buckets"]["0.01-0.1 ms"] == {"count": 2, "ms": pytest.approx(0.07)}
    assert sum(b["count"] for b in gaps["buckets"].values()) == 2
    assert [(g["ms"], g["at_ms"]) for g in gaps["longest"]] == pytest.approx([(0.05, 0.1), (0.02, 0.28)])
    assert breakdown["host_scopes"] == [
        {"scope": "llm_engine step: get_output", "calls": 2, "ms": pytest.approx(0.14)}
    ]

    # A part's end marked at 140 us (bench_grpo: the scoring's): each part gets the timeline of its own kernels.
    events.append(event(SEGMENT_END + "scoring", 140, 140.1, cpu))
    parts = kernel_breakdown(prof, rest="micro_batches")["timeline_parts"]
    assert parts["scoring"] == pytest.approx(kernel_timeline(kernels[:2]))
    assert parts["micro_batches"] == pytest.approx(kernel_timeline(kernels[2:], untraced=[(300.5, 1300)]))


def test_idle_gaps_sort_many_short_waits_from_a_few_stalls():
    """Per-step waits of 0.5 ms between 1 ms kernels, and one 30 ms stall: each in its bucket, the stall longest."""
    from benchmarks.common import idle_gaps

    spans, t = [], 0.0
    for step in range(10):
        spans.append((t, t + 1000))
        t += 1000 + (30_000 if step == 4 else 500)  # us
    gaps = idle_gaps(spans, longest=2)
    assert gaps["buckets"]["0.1-1 ms"] == {"count": 8, "ms": pytest.approx(4.0)}
    assert gaps["buckets"]["over 10 ms"] == {"count": 1, "ms": pytest.approx(30.0)}
    assert gaps["longest"][0] == {"ms": pytest.approx(30.0), "at_ms": pytest.approx(5.0 + 4 * 0.5)}
    assert idle_gaps([(0, 10), (5, 20)])["longest"] == []  # overlapping kernels: no gap


def test_stack_sampler_charges_the_wall_time_to_where_the_thread_was():
    """A thread that computes in Python for a while, then waits as long: each part gets about half the sampled time,
    though a waiting thread is sampled far more often than one holding the interpreter."""
    import time as clock

    from benchmarks.host_sampling import GcPauses, StackSampler

    def computing(seconds):
        end, x = clock.perf_counter() + seconds, 0
        while clock.perf_counter() < end:
            x += 1
        return x

    def waiting(seconds):
        clock.sleep(seconds)

    import threading

    stop = threading.Event()
    poller = threading.Thread(target=stop.wait, name="poller")
    poller.start()
    with StackSampler(interval_s=0.001) as sampler, GcPauses() as pauses:
        computing(0.4)
        waiting(0.4)
        import gc

        gc.collect(0)  # (a young collection: a full one in a large test process holds the interpreter for long)
    summary = sampler.summary()
    shares = {row["frame"].rsplit(":", 1)[1]: row["share"] for row in summary["inclusive"]}
    assert summary["samples"] >= 20
    assert 0.3 < shares["computing"] < 0.7 and 0.3 < shares["waiting"] < 0.7
    assert summary["leaf"][0]["frame"].endswith(
        ("test_benchmark_scripts.py:computing", "test_benchmark_scripts.py:waiting")
    )
    assert sum(row["ms"] for row in summary["leaf"]) == pytest.approx(1e3 * sampler.seconds, rel=0.1)
    assert pauses.record()["collections"] >= 1 and pauses.record()["by_generation"][0] >= 1
    stop.set()
    poller.join()
    poller_rows = [row for row in summary["other_threads"] if row["thread"] == "poller"]
    assert poller_rows and poller_rows[0]["frame"].endswith("threading.py:wait")
    assert poller_rows[0]["ms"] == pytest.approx(1e3 * sampler.seconds, rel=0.2)


def test_host_timers_time_each_engine_call_and_leave_the_engine_as_it_was():
    """`HostTimers` charges each of an engine step's calls its own time (a fake engine whose scheduler sleeps 2 ms
    and whose output processor 1 ms a step), the step's rest is the time outside them, and every call is the
    engine's own again afterwards; calls this vLLM lacks are named, not invented."""
    import time as clock
    from types import SimpleNamespace

    from benchmarks.host_timers import HostTimers

    class Scheduler:
        def schedule(self):
            clock.sleep(0.002)

        def update_from_output(self):
            pass

    import torch

    scheduler = Scheduler()
    runner = SimpleNamespace(prepare_inputs=lambda: clock.sleep(0.001))
    executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
    executor.execute_model = lambda: executor.driver_worker.worker.model_runner.prepare_inputs()
    core = SimpleNamespace(scheduler=scheduler, model_executor=executor)
    core.step_fn = lambda: (core.scheduler.schedule(), core.model_executor.execute_model(),
                            core.scheduler.update_from_output())  # fmt: skip
    event_wait = torch.cuda.Event.synchronize
    processor = SimpleNamespace(process_outputs=lambda: clock.sleep(0.001))
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core), output_processor=processor)

    def step():
        core.step_fn()
        engine.output_processor.process_outputs()
        clock.sleep(0.001)  # the loop's own time

    engine.step = step
    llm = SimpleNamespace(llm_engine=engine)
    with HostTimers(llm) as timers:
        for _ in range(20):
            llm.llm_engine.step()
    summary = timers.summary()
    ms = summary["ms_per_step"]
    assert summary["steps"] == 20 and summary["calls"]["scheduler.schedule"] == 20
    assert 2.0 <= ms["scheduler.schedule"] < 4.0 and 1.0 <= ms["output_processor.process_outputs"] < 3.0
    assert 1.0 <= ms["rest of the step"] < 3.0
    assert ms["llm_engine.step"] == pytest.approx(ms["engine_core.step"] + ms["output_processor.process_outputs"]
                                                  + ms["rest of the step"], rel=0.05)  # fmt: skip
    inside = summary["in_executor_ms_per_step"]  # inside execute_model, not beside it: not in the step's rest
    assert 1.0 <= inside["runner.prepare_inputs"] <= ms["executor.execute_model"] and "runner.prepare_inputs" not in ms
    assert "executor.sample_tokens" in summary["missing"] and "stats.record" in summary["missing"]
    assert torch.cuda.Event.synchronize is event_wait and "prepare_inputs" in runner.__dict__  # restored
    assert "step" not in engine.__dict__ or engine.step is step  # restored
    assert "schedule" not in scheduler.__dict__ and core.step_fn.__name__ == "<lambda>"
    assert "process_outputs" in processor.__dict__ and processor.process_outputs.__name__ == "<lambda>"


def test_the_model_runners_calls_get_named_host_scopes_while_profiled():
    """vLLM's V2 model runner names no profiler scopes of its own: while a rollout is profiled, its `execute_model` and
    `sample_tokens` run inside `model_runner: ...` scopes (counted by `host_scopes`), and are themselves again after."""
    from types import SimpleNamespace

    import torch

    from benchmarks.bench_grpo import named_model_runner_calls
    from benchmarks.common import host_scopes

    class Runner:
        def execute_model(self, x):
            return x + 1

        def sample_tokens(self, x):
            return x * 2

    runner = Runner()
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))))  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with named_model_runner_calls(llm):
            assert [runner.sample_tokens(runner.execute_model(i)) for i in range(3)] == [2, 4, 6]
    scopes = {s["scope"]: s["calls"] for s in host_scopes(prof.events())}
    assert scopes == {"model_runner: execute_model": 3, "model_runner: sample_tokens": 3}
    assert "execute_model" not in vars(runner) and runner.execute_model(1) == 2
    with named_model_runner_calls(SimpleNamespace()):  # no in-process engine: nothing to name
        pass


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")  # (a window from the first step has none)
def test_a_rollout_profile_window_records_only_its_engine_steps_around_the_middle():
    """`--profile_engine_steps K`: the profiler steps once per engine step and records K of them around the middle of
    the rollout's decode steps (an 8B rollout's every kernel would be a million events)."""
    import torch

    from benchmarks.bench_grpo import profile_window_steps, rollout_profile_window

    assert profile_window_steps(2048, 200) == [924, 1124]
    assert profile_window_steps(20, 40) == [0, 40] and profile_window_steps(2048, None) is None
    assert rollout_profile_window(2048, None) is None
    for completion_len, steps in ((20, 4), (4, 8)):
        recorded = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=rollout_profile_window(completion_len, steps)) as prof:  # fmt: skip
            for i in range(24):
                with torch.profiler.record_function(f"engine step {i}"):
                    torch.ones(2).add_(1)
                prof.step()
        recorded = sorted(int(e.name.rsplit(" ", 1)[1]) for e in prof.events() if e.name.startswith("engine step"))
        first, end = profile_window_steps(completion_len, steps)
        assert recorded == list(range(first, end)), (completion_len, steps, recorded)


def test_launch_lag_says_whether_the_gpu_waits_on_the_host():
    """Each kernel's start on the GPU against its launch on the host (paired by correlation id): a queue of work gives
    long lags, a GPU waiting on the host starts kernels within microseconds of their launch."""
    from benchmarks.common import launch_lag

    launches = {1: 0, 2: 1_000_000, 3: 2_000_000, 4: 3_000_000}  # ns
    queued = launch_lag(launches, [(1, 5_000_000), (2, 6_000_000), (3, 7_000_000), (4, 8_000_000), (9, 9_000_000)])
    assert queued["kernels"] == 4 and queued["paired_fraction"] == 0.8  # kernel 9's launch fell outside the trace
    assert queued["median_ms"] == pytest.approx(5.0) and queued["within_0.1_ms"] == 0
    starved = launch_lag(launches, [(1, 20_000), (2, 1_030_000), (3, 2_010_000), (4, 3_500_000)])
    assert starved["p10_ms"] == pytest.approx(0.01) and starved["within_0.1_ms"] == 0.75
    assert starved["p90_ms"] == pytest.approx(0.5)
    assert launch_lag(launches, [(7, 1)]) is None
    assert launch_lag(launches, [(2, 0), (3, 2_000_500)])["misordered"] == 1  # kernel 2 "before" its launch


@pytest.mark.parametrize("micro_batches, scoring", [(None, False), (3, False), (9, False), (3, True)])
def test_step_profiler_covers_the_step_or_the_micro_batches_after_its_first(micro_batches, scoring):
    """bench_grpo --profile_step S [--profile_micro_batches N [--profile_scoring]]: the whole training phase of step S,
    or N micro-batches after its first (which also scores the rollout), or those from the step's start; asked for
    more than the step has, it stops at the step's end."""
    from types import SimpleNamespace

    from benchmarks.bench_grpo import StepProfiler

    events = []
    profiler = StepProfiler(1, micro_batches, lambda: events.append("start"), lambda: events.append("stop"), scoring)
    state = SimpleNamespace(global_step=0)

    def step(micro: int):  # as transformers' Trainer calls the callbacks for one optimizer step of `micro` batches
        profiler.on_step_begin(None, state, None)
        for i in range(micro):
            events.append("mb")
            if i < micro - 1:
                profiler.on_substep_end(None, state, None)
        profiler.on_step_end(None, state, None)
        state.global_step += 1

    for _ in range(3):
        step(8)
    step0, step1 = events[:8], events[8 : events.index("stop") + 1]
    assert step0 == ["mb"] * 8 and events.count("start") == events.count("stop") == 1
    if micro_batches is None:
        assert step1 == ["start", *["mb"] * 8, "stop"]
    elif scoring:
        assert step1 == ["start", "mb", *["mb"] * micro_batches, "stop"] and profiler.profiled == micro_batches
    else:
        covered = min(micro_batches, 7)
        assert step1 == ["mb", "start", *["mb"] * covered, "stop"] and profiler.profiled == covered


def test_a_profiled_step_is_summed_up_for_every_rank(tmp_path):
    """Under several processes every rank profiles the same step; rank 0's row holds each one's timeline, launch lag
    and NCCL spread (the longest kernels' list stays with rank 0's own), gathered with one collective."""
    import torch.distributed as dist

    from benchmarks.bench_grpo import ranks_profiles

    profile = {"timeline": {"span_ms": 5.0}, "launch_lag": {"median_ms": 0.01}, "top_kernels": [],
               "nccl_kernels": {"count": 3, "median_ms": 1.0, "longest": [{"ms": 2.0}]}}  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert ranks_profiles(profile, 1) == [
            {
                "timeline": {"span_ms": 5.0},
                "timeline_parts": None,
                "launch_lag": {"median_ms": 0.01},
                "nccl_kernels": {"count": 3, "median_ms": 1.0},
            }  # fmt: skip
        ]
    finally:
        dist.destroy_process_group()


def test_every_rank_reports_its_own_phases_and_device_peaks(tmp_path):
    """A several-process row holds each rank's per-step phases and device peaks, gathered with one collective: where
    one rank's rollout is slower, the others show it as longer scoring (they wait in its gathers)."""
    import torch.distributed as dist

    from benchmarks.bench_grpo import ranks_phases

    row = {"per_step": {"rollout_s": [37.4], "scoring_s": [6.7]}, "peak_device_memory_by_phase_gib": {"rollout": 77.2},
           "step_time": {"step_s": 76.4}}  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert ranks_phases(row, 1) == [
            {"per_step": row["per_step"], "peak_device_memory_by_phase_gib": {"rollout": 77.2}}
        ]
    finally:
        dist.destroy_process_group()


def test_every_grpo_run_sets_only_fields_the_configs_have():
    """A misspelt option of a `bench_grpo` run would fail only on the GPU host, after minutes of set-up: each run's
    options are fields of the config its trainer takes (TRL's runs: `GRPOConfig`; ours: `FP8GRPOConfig`), and its
    tuning builds an `FP8Tuning` (runs of FP8GRPOTrainer only)."""
    from dataclasses import fields

    from trl import GRPOConfig

    from benchmarks.bench_grpo import RUN_OPTIONS, RUN_TUNING, RUNS
    from trl_fp8 import FP8GRPOConfig, FP8Tuning

    assert set(RUN_OPTIONS) <= set(RUNS) and set(RUN_TUNING) <= set(RUNS)
    for run, options in RUN_OPTIONS.items():
        config = GRPOConfig if RUNS[run][0] == "trl" else FP8GRPOConfig
        assert set(options) <= {f.name for f in fields(config)}, run
    for run, tuning in RUN_TUNING.items():
        assert RUNS[run][0] == "trl_fp8" and FP8Tuning(**tuning) != FP8Tuning(), run
    assert RUN_OPTIONS["fp8_defaults_scoring_pass"]["score_in_training_forward"] is False


def test_a_failed_run_leaves_its_exit_code_and_stderr_tail_in_the_results_file(tmp_path, monkeypatch, capsys):
    from benchmarks import common

    child = ("import json, sys\n"
             "name = sys.argv[2]\n"
             "print('starting', name, file=sys.stderr)\n"
             "if name == 'bad':\n"
             "    raise SystemExit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB')\n"
             "print(json.dumps({'name': name}))\n")  # fmt: skip
    monkeypatch.setattr(common, "module_command", lambda module, launcher=None: [sys.executable, "-c", child])
    out, result = tmp_path / "out.json", {"results": []}
    assert common.run_all("m", "--run", ["bad", "good"], [], result, out, "name", ["good", "bad"]) == ["bad"]
    written = json.loads(out.read_text())
    assert written["results"] == [{"name": "good"}] and written["failed_runs"] == ["bad"]
    failure = written["failures"]["bad"]
    assert failure["exit"] == 1 and failure["stderr_tail"] == ["starting bad", "torch.OutOfMemoryError: CUDA out of "
                                                               "memory. Tried to allocate 2.00 GiB"]  # fmt: skip
    assert failure["errors"] == ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert "starting good" in capsys.readouterr().err  # the children's stderr still reaches the log as they run


def test_a_failed_launch_keeps_the_causes_not_the_launchers_summary():
    """vLLM's C++ failures print to stdout and each rank prefixes its traceback; torchrun's summary ends stderr."""
    from benchmarks.common import error_lines

    stdout = "{'not': 'json'}\nFailed: Cuda error /workspace/csrc/custom_all_reduce.cuh:455 'invalid argument'\n"
    stderr = ("[rank0]: RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR\n"
              "[rank1]: RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "  error_file: <N/A>\n  exitcode  : 1 (pid: 1512)\n")  # fmt: skip
    assert error_lines(stderr, stdout) == [
        "RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL_ERROR",
        "Failed: Cuda error /workspace/csrc/custom_all_reduce.cuh:455 'invalid argument'",
    ]


def test_cpu_affinity_is_accelerates_own_launch_option():
    """`--cpu_affinity` pins each rank to its GPU's NUMA node with accelerate's option (one process: no launcher)."""
    from accelerate.commands.launch import launch_command_parser

    from benchmarks.bench_grpo import launcher

    assert launcher(1, "multi_gpu", 29500, cpu_affinity=True) is None
    plain, pinned = launcher(4, "multi_gpu", 29500), launcher(4, "multi_gpu", 29500, cpu_affinity=True)
    assert pinned == [*plain, "--enable_cpu_affinity"]
    # (the arguments after `python -m accelerate.commands.launch`)
    parsed = launch_command_parser().parse_args([*pinned[3:], "train.py"])
    assert parsed.enable_cpu_affinity and parsed.num_processes == 4


def test_bench_grpo_reads_the_fp8_generations_own_engine_statistics(monkeypatch):
    """FP8VLLMGeneration keeps its engine statistics in `report.rollout_stats`, which its trainer logs as `vllm/*`:
    the benchmark reads those, and attaches a reader of its own only to TRL's generation (attaching one to an FP8
    engine would take the engine's stat loggers from the trainer's, which would then log nothing)."""
    from types import SimpleNamespace

    from benchmarks.bench_grpo import engine_stats
    from trl_fp8.rollout.stats import RolloutStats
    from trl_fp8.rollout.vllm.generation import RolloutReport

    attached = []
    monkeypatch.setattr(RolloutStats, "attach", classmethod(lambda cls, llm: attached.append(llm) or cls()))
    own = RolloutStats()
    assert engine_stats(SimpleNamespace(report=RolloutReport(rollout_stats=own), llm="fp8 engine")) is own
    assert attached == []
    trl_stats = engine_stats(SimpleNamespace(llm="TRL's engine"))
    assert isinstance(trl_stats, RolloutStats) and trl_stats is not own and attached == ["TRL's engine"]


def test_moe_decode_tuning_times_configurations_vllms_kernel_accepts_and_writes_vllms_file_format(tmp_path):
    """`--tune`'s candidates obey the block-FP8 rule of vLLM's own tuner (a 128x128 weight block holds whole N and K
    tiles), add 64-row tiles only once the experts average 16 rows, and the written file keeps vLLM's entries except
    at the tuned token counts, in vLLM's format (string keys, `triton_version`)."""
    from types import SimpleNamespace

    from benchmarks import bench_moe_decode as bench

    shape = bench.Shape(2048, 768, 128, 8)
    small, large = bench.tune_candidates(shape, 64, "fp8"), bench.tune_candidates(shape, 512, "fp8")
    for config in small + large:
        assert set(config) == set(bench.TUNE_KEYS)
        assert 128 % config["BLOCK_SIZE_N"] == 0 and 128 % config["BLOCK_SIZE_K"] == 0
    assert {c["BLOCK_SIZE_M"] for c in small} == {16, 32} and {c["BLOCK_SIZE_M"] for c in large} == {16, 32, 64}
    assert len({bench._config_key(c) for c in large}) == len(large)

    name = "E=128,N=768,device_name=TEST,dtype=fp8_w8a8,block_shape=[128,128].json"
    (tmp_path / "configs").mkdir()
    shipped = {"16": {"BLOCK_SIZE_M": 16, "tag": "vllm16"}, "64": {"BLOCK_SIZE_M": 16, "tag": "vllm64"},
               "4096": {"BLOCK_SIZE_M": 64, "tag": "vllm4096"}, "triton_version": "x"}  # fmt: skip
    (tmp_path / "configs" / name).write_text(json.dumps(shipped))
    fused_moe = SimpleNamespace(__file__=str(tmp_path / "fused_moe.py"), get_config_file_name=lambda *a: name)
    api = SimpleNamespace(fused_moe=fused_moe)
    tuned = {"BLOCK_SIZE_M": 32, "tag": "tuned64"}
    tuning = [{"dtype": "fp8", "tokens": 64, "kept": True, "chosen": tuned},
              {"dtype": "fp8", "tokens": 16, "kept": False, "chosen": shipped["16"]},
              {"dtype": "bf16", "tokens": 4096, "kept": True, "chosen": {"tag": "bf16"}}]  # fmt: skip
    path = bench.write_tuned_configs(api, shape, tuning, str(tmp_path / "out"))
    written = json.loads(Path(path).read_text())
    assert Path(path).name == name and "triton_version" in written
    assert {k: v["tag"] for k, v in written.items() if k != "triton_version"} == {
        "16": "vllm16", "64": "tuned64", "4096": "vllm4096"}  # fmt: skip
    assert bench.write_tuned_configs(api, shape, tuning[1:2], str(tmp_path / "none")) is None


def test_engine_probe_times_the_trainers_engine_with_each_sampling_and_the_memory_sampler_running(monkeypatch):
    """`--engine_probe`: one rollout per sampling set on the trainer's own engine, the first with the fields TRL's
    colocated rollouts use (its log-probs and `generation_kwargs` included, `ignore_eos` among them as bench_grpo
    sets it), every one `ignore_eos` at the requested length after the prefix cache is emptied, then the trainer's
    with the memory sampler's thread alive and with the garbage collector off, each charged its own time per decode
    step and its host calls' time."""
    import gc
    import types
    from types import SimpleNamespace

    import torch

    import benchmarks.bench_grpo as bench_grpo

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **fields: fields  # a field given twice fails as vLLM's does
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    sampling_thread = []

    class Sampler:
        def start(self):
            sampling_thread.append("running")

        def stop(self):
            sampling_thread.append("stopped")

    monkeypatch.setattr(bench_grpo, "DeviceMemorySampler", Sampler)
    calls, resets = [], []

    def generate(prompts, params, use_tqdm):
        calls.append((prompts, params, list(sampling_thread), gc.isenabled(), len(resets)))
        time.sleep(0.01 * len(calls))  # each later rollout slower: each must get its own time

    def step():
        pass

    llm = SimpleNamespace(generate=generate, reset_prefix_cache=lambda: resets.append(1), llm_engine=SimpleNamespace(
        step=step, model_config=SimpleNamespace(get_vocab_size=lambda: 1000),
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True))))  # fmt: skip
    generation = SimpleNamespace(llm=llm, repetition_penalty=1.0, temperature=0.7, top_p=0.9, top_k=0, min_p=None,
                                 logprobs=0, generation_kwargs={"detokenize": False, "flat_logprobs": True,
                                                                "ignore_eos": True})  # fmt: skip
    probe = bench_grpo.engine_probe(generation, seqs=4, prompt_len=3, new_tokens=5)

    assert [c[1]["logprobs"] for c in calls[:2]] == [0, None] and "seed" in calls[2][1]
    trainer_fields = {"n": 1, "repetition_penalty": 1.0, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
                      "logprobs": 0, "detokenize": False, "flat_logprobs": True, "max_tokens": 5, "ignore_eos": True}  # fmt: skip
    assert calls[0][1] == calls[3][1] == calls[4][1] == trainer_fields
    assert all(c[1]["max_tokens"] == 5 and c[1]["ignore_eos"] for c in calls)
    assert [c[2] for c in calls] == [[], [], [], ["running"], ["running", "stopped"]]
    assert [c[3] for c in calls] == [True] * 4 + [False] and gc.isenabled()
    assert [c[4] for c in calls] == [1, 2, 3, 4, 5]  # the prefix cache emptied before each
    prompts = calls[0][0]
    assert len(prompts) == 4 and all(len(p["prompt_token_ids"]) == 3 for p in prompts)
    assert all(c[0] == prompts for c in calls)  # the same prompts every time
    times = probe["ms_per_decode_step"]
    assert list(times) == ["trainer", "trainer_no_logprobs", "bench_rollout", "trainer_with_memory_sampler",
                           "trainer_gc_off"]  # fmt: skip
    values = list(times.values())
    assert values == sorted(values) and len(set(values)) == 5
    assert times["trainer"] >= 10 / 5 and probe["prefix_caching"] is True
    assert set(probe["host"]) == set(times) and "scheduler.schedule" in probe["host"]["trainer"]["missing"]
    assert "step" in llm.llm_engine.__dict__ and llm.llm_engine.step is step  # the engine's own call again
    assert probe["process"]["threads"] and probe["process"]["gc_objects"] > 0


def test_engine_kwargs_go_over_the_trainers_own_engine_arguments():
    """`bench_grpo --engine_kwargs`: an engine setting measured inside the trainer wins over what the trainer (and
    trl-fp8) pass, which win over the benchmark's defaults (statistics on, this host's tensor-parallel settings)."""
    from benchmarks.bench_grpo import benchmark_llm

    built = []
    llm = benchmark_llm(lambda *a, **kw: built.append((a, kw)), {"disable_custom_all_reduce": True},
                        {"enable_prefix_caching": False})  # fmt: skip
    llm("model", enable_prefix_caching=True, disable_log_stats=True, seed=3)
    assert built == [(("model",), {"disable_log_stats": True, "disable_custom_all_reduce": True,
                                   "enable_prefix_caching": False, "seed": 3})]  # fmt: skip
    built.clear()
    benchmark_llm(lambda *a, **kw: built.append(kw), {}, {})(model="m")
    assert built == [{"disable_log_stats": False, "model": "m"}]


def test_engine_probe_wakes_a_sleeping_engine_with_its_weights_pushed_again(monkeypatch):
    """Under sleep mode TRL puts the engine to sleep after every rollout, its weights let go: the probe pushes them
    again and wakes the KV cache, as a rollout does, before it generates."""
    import types
    from types import SimpleNamespace

    import torch

    import benchmarks.bench_grpo as bench_grpo

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **fields: fields
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(
        bench_grpo, "DeviceMemorySampler", lambda: SimpleNamespace(start=lambda: None, stop=lambda: None)
    )
    events = []
    llm = SimpleNamespace(
        generate=lambda prompts, params, use_tqdm: events.append("generate"),
        wake_up=lambda tags: events.append(f"wake {tags}"), reset_prefix_cache=lambda: None,
        llm_engine=SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 100),
                                   vllm_config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True))),
    )  # fmt: skip
    generation = SimpleNamespace(llm=llm, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                 logprobs=0, generation_kwargs={}, enable_sleep_mode=True,
                                 sync_weights=lambda: events.append("sync"))  # fmt: skip
    bench_grpo.engine_probe(generation, seqs=2, prompt_len=2, new_tokens=2)
    assert events[:3] == ["sync", "wake ['kv_cache']", "generate"] and events.count("generate") == 5


def test_the_exact_run_keeps_every_steps_largest_difference_and_asks_for_what_exact_mode_needs(tmp_path, fake_vllm):
    """`fp8_exact`'s claim is a maximum over every step, so its row keeps each step's mismatch, warm-up included; its
    settings pass exact mode's own checks (a BF16 KV cache, the colocated engine)."""
    from benchmarks.bench_grpo import RUN_OPTIONS, RUNS, mismatch_by_step
    from trl_fp8 import FP8GRPOConfig

    history = [
        {"step": 1, "loss": 0.1, "fp8/mismatch/abs_logp_diff_max": 0.0, "fp8/mismatch/kl_k3": 0.0},
        {"step": 1, "train_runtime": 3.0},  # the Trainer's closing entry: no mismatch, left out
        {"step": 2, "fp8/mismatch/abs_logp_diff_max": 0.25, "fp8/mismatch/kl_k3": 1e-3},
    ]
    assert mismatch_by_step(history) == [
        {"step": 1, "fp8/mismatch/abs_logp_diff_max": 0.0, "fp8/mismatch/kl_k3": 0.0},
        {"step": 2, "fp8/mismatch/abs_logp_diff_max": 0.25, "fp8/mismatch/kl_k3": 1e-3},
    ]
    _, recipe, precision, fp8_kv, backend, _ = RUNS["fp8_exact"]
    config = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, vllm_mode="colocate",
                           fp8_recipe=recipe, rollout_precision=precision, fp8_kv_cache=fp8_kv, fp8_backend=backend,
                           **RUN_OPTIONS["fp8_exact"])  # fmt: skip
    assert config.exact_on_policy and config.fp8_kv_cache is False
