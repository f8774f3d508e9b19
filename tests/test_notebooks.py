"""The notebooks run top to bottom on CPU (executed with nbclient, as a user would run them)."""

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["quickstart.ipynb"])
def test_notebook_executes(name, tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    env_steps = os.environ.get("QUICKSTART_STEPS")
    os.environ.setdefault("QUICKSTART_STEPS", "12")  # executes end to end; learning is tested elsewhere
    try:
        NotebookClient(
            nb, timeout=HANG_GUARD_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        if env_steps is None:
            os.environ.pop("QUICKSTART_STEPS", None)
    outputs = "".join(
        o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    )
    assert "FP8 (blockwise): 28 linear layers converted" in outputs
    assert "No FP8 (fp8_recipe=None): every layer trains in high precision" in outputs
    assert "'quant_method': 'fp8'" in outputs.replace('"', "'")
    for run in ("FP8", "BF16"):  # the reloaded checkpoints are asked every letter
        assert f"greedy accuracy over all 8 letters, {run} GRPO, saved checkpoint: " in outputs
    images = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the reward plot was not drawn"


def test_results_notebook_redraws_the_committed_results(tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / "fp8_vs_bf16.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=HANG_GUARD_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = "".join(
        o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    )
    assert "vllm_fp8" in outputs and "rollout_NVIDIA_H200.json" in outputs
    # The step-time and accuracy tables carry the numbers of the committed JSON, every run and seed.
    results = ROOT / "benchmarks" / "results"
    from benchmarks.plot_results import LONG_TASKS, SEPARATE_STUDIES, _convergence_runs, capacity_series, speed_results

    for _, speed in speed_results(results):  # each regime: 64 x 1k, and the long one once it has run
        for row in speed["results"]:
            assert f"| {row['name']} | {row['step_time']['step_s']:.2f} |" in outputs
    for profiled in results.glob("rollout_long_*.json"):  # the long regime's profiled rollouts, every engine
        for row in json.loads(profiled.read_text())["results"]:
            assert f"| {row['engine']} | {row['points'][0]['tokens_per_s']:.0f} |" in outputs
    runs = list(results.glob("convergence*/grpo_*.json"))
    for run in map(json.loads, (p.read_text() for p in runs)):
        final = 100 * run["held_out"][-1]["held_out_accuracy"]
        assert f"| {run['setting']['name']} | {run['args']['seed']} |" in outputs and f"{final:.2f}" in outputs
    images = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    long_tasks = [task for task in LONG_TASKS if _convergence_runs(results, task)]
    studies = [folder for folder in SEPARATE_STUDIES if _convergence_runs(results, folder=folder)]
    expected = 3 + 1 + bool(capacity_series(results)) + len(speed_results(results)) + 1 + 4 * len(long_tasks)
    expected += 3 * len(studies) + len(list(results.glob("grpo_bestfit_*.json")))
    assert len(images) == expected, (
        "expected the three convergence plots, rollout throughput, rollouts at matched memory, GRPO step time per "
        "regime, linear speed-up, per long-completion task its three curves and the mismatch along the completion, "
        "per study of its own (the FP8 KV cache's cost) its three curves, and per best-fit file its step times"
    )
