"""`benchmarks.collect_scaling`: FP8 against TRL BF16 only between flows that ran side by side (one results file),
weak-scaling efficiency against each flow's own one-GPU rate, and inputs of one per-GPU workload only."""

import json

import pytest

from benchmarks.collect_scaling import collect, main, merge_side_by_side, table

pytestmark = pytest.mark.benchmark_scripts  # not in the default run; `-m benchmark_scripts` runs them

WORKLOAD = {"shape": "8b", "prompt_len": 256, "completion_len": 2048, "generation_batch": 128, "num_generations": 8,
            "micro_batch": 8, "vllm_memory": 0.3, "sleep_mode": True}  # fmt: skip


def result(gpus: int, launch: str, optim: str, steps: dict[str, float], **workload) -> dict:
    """A bench_grpo results file: per flow its median step (rollout and training halves), completions per second
    over all GPUs (`generation_batch` per GPU)."""
    settings = {**WORKLOAD, **workload, "num_processes": gpus, "launch_config": launch, "optim": optim}
    rows = [{"name": name, "step_time": {"step_s": s, "rollout_s": s / 2, "training_s": s / 2},
             "completions_per_s": settings["generation_batch"] * gpus / s} for name, s in steps.items()]  # fmt: skip
    return {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26", "settings": settings, "results": rows}


def test_speedups_within_a_file_and_efficiency_against_one_gpu():
    one = result(1, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 120.0, "unified_fp8kv": 80.0})
    ddp = result(2, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 125.0, "unified_fp8kv": 84.0})
    fsdp2 = result(4, "fsdp2", "adamw_torch_fused", {"unified_fp8kv": 100.0})  # no TRL BF16 beside it
    rows = {(r["gpus"], r["launch"], r["flow"]): r for r in collect([ddp, one, fsdp2])["rows"]}
    assert rows[(1, "1 GPU", "unified_fp8kv")]["speedup_vs_trl_bf16"] == pytest.approx(1.5)
    assert rows[(2, "DDP", "unified_fp8kv")]["speedup_vs_trl_bf16"] == pytest.approx(125 / 84)
    assert rows[(4, "FSDP2", "unified_fp8kv")]["speedup_vs_trl_bf16"] is None  # never across files
    # the same work per GPU: efficiency is the one-GPU step time over the N-GPU one
    assert rows[(2, "DDP", "trl_bf16")]["weak_scaling_efficiency"] == pytest.approx(120 / 125)
    assert rows[(4, "FSDP2", "unified_fp8kv")]["weak_scaling_efficiency"] == pytest.approx(80 / 100)
    assert rows[(1, "1 GPU", "trl_bf16")]["weak_scaling_efficiency"] == pytest.approx(1.0)
    text = table(collect([one, fsdp2]))
    assert "| 4 | FSDP2 | unified_fp8kv | adamw_torch_fused | 100.0 |" in text
    assert text.split("\n")[3].endswith("| 1.50x | 1.00 |")  # (after TRL BF16, the baseline)
    assert text.endswith("| 5.12 | - | 0.80 |")  # no TRL BF16 beside it: no ratio


def test_each_ranks_rollout_is_shown_as_a_range_over_the_timed_steps():
    ddp = result(4, "multi_gpu", "adamw_bnb_8bit", {"unified_fp8kv": 80.0})
    ddp["settings"]["median_steps"] = [1, 2]  # step 0 is the warm-up: never in the range
    ddp["results"][0]["by_rank"] = [{"per_step": {"rollout_s": [99.0, r, r + 2]}} for r in (30.0, 31.0, 36.0, 32.0)]
    row = collect([ddp])["rows"][0]
    assert row["rollout_s_by_rank"] == [31.0, 32.0, 37.0, 33.0]
    assert "| 40.0 | 31.0-37.0 | 40.0 |" in table(collect([ddp]))
    one = result(1, "multi_gpu", "adamw_bnb_8bit", {"unified_fp8kv": 80.0})  # one process: no ranks to compare
    assert "| 40.0 | - | 40.0 |" in table(collect([one]))


def test_other_per_gpu_workloads_are_refused():
    with pytest.raises(ValueError, match="completion_len"):
        collect([result(1, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 1.0}),
                 result(2, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 1.0}, completion_len=1024)])  # fmt: skip


def test_the_command_writes_the_table_and_its_inputs(tmp_path, capsys):
    paths = []
    for i, r in enumerate([result(1, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 2.0, "unified_fp8kv": 1.0}),
                           result(2, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 2.0, "unified_fp8kv": 1.25})]):  # fmt: skip
        paths.append(tmp_path / f"in{i}.json")
        paths[-1].write_text(json.dumps(r))
    main([*map(str, paths), "--out", str(tmp_path / "scaling.json")])
    out = json.loads((tmp_path / "scaling.json").read_text())
    assert (
        out["devices"] == ["NVIDIA H100 80GB HBM3"]
        and len(out["rows"]) == 4
        and out["inputs"] == list(map(str, paths))
    )
    assert "| 2 | DDP | unified_fp8kv |" in capsys.readouterr().out


def test_a_failed_run_gets_a_row_marked_failed_and_the_plot_is_drawn(tmp_path, capsys):
    """bench_grpo's `failed_runs` (TRL BF16 out of memory beside a finished FP8 run): a row marked failed, no speed-up
    for the flow that ran beside it, and an efficiency only where the flow ran on one GPU too."""
    one = result(1, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 120.0, "unified_fp8kv": 80.0})
    oom = {"exit": 1, "stderr_tail": ["torch.OutOfMemoryError: CUDA out of memory."]}
    ddp = {**result(2, "multi_gpu", "adamw_bnb_8bit", {"unified_fp8kv": 84.0}), "failed_runs": ["trl_bf16"],
           "failures": {"trl_bf16": oom}}  # fmt: skip
    scaling = collect([one, ddp])
    rows = {(r["gpus"], r["flow"]): r for r in scaling["rows"]}
    assert rows[(2, "trl_bf16")]["failed"] and rows[(2, "trl_bf16")]["weak_scaling_efficiency"] is None
    assert rows[(2, "trl_bf16")]["failure"] == oom and rows[(1, "trl_bf16")].get("failure") is None
    assert rows[(2, "unified_fp8kv")]["speedup_vs_trl_bf16"] is None
    assert rows[(2, "unified_fp8kv")]["weak_scaling_efficiency"] == pytest.approx(80 / 84)
    assert "| 2 | DDP | trl_bf16 | adamw_bnb_8bit | failed |" in table(scaling)
    paths = []
    for i, r in enumerate([one, ddp]):
        paths.append(tmp_path / f"in{i}.json")
        paths[-1].write_text(json.dumps(r))
    main([*map(str, paths), "--out", str(tmp_path / "scaling.json"), "--plot", str(tmp_path / "plots" / "s.png")])
    assert (tmp_path / "plots" / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flows_run_at_once_on_disjoint_gpus_count_as_one_side_by_side_file(tmp_path, capsys):
    """`bf16.json+fp8.json`: TRL BF16 on GPUs 0-1 and FP8 on GPUs 2-3 at the same time give one speed-up; files of
    other launches, GPU counts or GPU models are refused."""
    bf16 = result(2, "multi_gpu", "adamw_bnb_8bit", {"trl_bf16": 120.0})
    fp8 = result(2, "multi_gpu", "adamw_bnb_8bit", {"unified_fp8kv_liger": 60.0})
    paths = [tmp_path / "bf16.json", tmp_path / "fp8.json"]
    for path, r in zip(paths, (bf16, fp8), strict=True):
        path.write_text(json.dumps(r))
    main([f"{paths[0]}+{paths[1]}", "--out", str(tmp_path / "scaling.json")])
    rows = {r["flow"]: r for r in json.loads((tmp_path / "scaling.json").read_text())["rows"]}
    assert rows["unified_fp8kv_liger"]["speedup_vs_trl_bf16"] == pytest.approx(2.0)
    assert "| 2 | DDP | unified_fp8kv_liger |" in capsys.readouterr().out
    for other in (result(4, "multi_gpu", "adamw_bnb_8bit", {"u": 1.0}), result(2, "fsdp2", "adamw_torch_fused", {"u": 1.0}),
                  {**result(2, "multi_gpu", "adamw_bnb_8bit", {"u": 1.0}), "device": "NVIDIA H200"}):  # fmt: skip
        with pytest.raises(ValueError, match="side-by-side files"):
            merge_side_by_side([bf16, other])


def test_split_engines_and_per_micro_batch_reduction_name_their_launch():
    """A run with engines over two GPUs each and accelerate's sync_each_batch is another launch than plain FSDP2:
    its label says so, and its speed-up is still against the TRL BF16 run beside it."""
    fsdp2 = result(4, "fsdp2", "adamw_torch_fused", {"trl_bf16": 150.0, "unified_fp8kv": 100.0}, shape="14b")
    fsdp2["settings"].update(vllm_tensor_parallel_size=2, sync_each_batch=True)
    rows = collect([fsdp2])["rows"]
    assert {row["launch"] for row in rows} == {"FSDP2, vLLM TP=2, sync_each_batch"}
    assert rows[1]["speedup_vs_trl_bf16"] == pytest.approx(1.5)
    ddp = result(4, "multi_gpu", "adamw_bnb_8bit", {"unified_fp8kv": 80.0})
    ddp["settings"]["cpu_affinity"] = True  # accelerate's --enable_cpu_affinity: ranks pinned to their GPU's cores
    assert collect([ddp])["rows"][0]["launch"] == "DDP, CPU affinity"


def test_collect_contention_gathers_each_gpus_row_and_its_clocks_at_work(tmp_path):
    """One file from the per-GPU runs of `run_rollout_report.sh contention`: each row tagged with its GPU, a run that
    wrote nothing left out, and per GPU the SM clock and power over the samples with the GPU at work."""
    from benchmarks import collect_contention

    header = {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "date": "2026-11-27", "versions": {"vllm": "0.26.0"},
              "command": "python -m benchmarks.bench_grpo ...", "settings": {"shape": "8b"}}  # fmt: skip
    paths = []
    for gpu, step in ((0, 69.0), (1, 70.5)):
        path = tmp_path / f"grpo_contention_run_gpu{gpu}_NVIDIA_H100_80GB_HBM3.json"
        row = {"name": "run", "step_time": {"step_s": step, "rollout_s": 34.0, "training_s": 35.0}}
        path.write_text(json.dumps({**header, "results": [row]}))
        paths.append(path)
    paths.append(tmp_path / "grpo_contention_run_gpu2_NVIDIA_H100_80GB_HBM3.json")  # never written
    clocks = tmp_path / "clocks.csv"
    clocks.write_text(
        "timestamp, index, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, "
        "utilization.gpu [%]\n"
        "t, 0, 345 MHz, 2619 MHz, 74.39 W, 51, 0 %\n"  # idle: not counted at work
        "t, 0, 1965 MHz, 2619 MHz, 650.00 W, 70, 100 %\n"
        "t, 0, 1425 MHz, 2619 MHz, 699.00 W, 75, 98 %\n"
        "t, 1, 1980 MHz, 2619 MHz, 600.00 W, 60, 90 %\n"
        "t, 1, 1980 MHz, 26\n"  # cut off when the logger stopped
    )
    out = tmp_path / "out.json"
    collect_contention.main([*map(str, paths), "--clocks", str(clocks), "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["gpu"], r["step_time"]["step_s"]) for r in result["results"]] == [(0, 69.0), (1, 70.5)]
    assert (result["device"], result["date"], result["runs_command"]) == (
        header["device"],
        "2026-11-27",
        header["command"],
    )
    gpu0 = result["gpu_clocks"]["0"]
    assert (gpu0["samples"], gpu0["busy_samples"], gpu0["temperature_c_max"]) == (3, 2, 75.0)
    assert gpu0["sm_clock_mhz_busy"] == {"median": 1695.0, "min": 1425.0, "max": 1965.0}
    assert gpu0["power_w_busy"]["max"] == 699.0 and result["gpu_clocks"]["1"]["busy_samples"] == 1


def test_collect_twins_gives_fp8s_own_ratio_beside_the_trainers(tmp_path, capsys):
    """Each FP8 run's step against TRL BF16, TRL BF16 + Liger and its BF16 twin (the same trainer in BF16), with the
    rollout and micro-batch ratios against the twin; a run missing from the file leaves its ratios out."""
    from benchmarks import collect_twins

    def run(name, recipe, step, rollout, micro, floor=None):
        return {"name": name, "fp8_recipe": recipe,
                "step_time": {"step_s": step, "rollout_s": rollout, "scoring_s": 1.0, "micro_batches_s": micro},
                "rollout_floor": {"floor_s": floor, "of_floor": floor / rollout} if floor else {}}  # fmt: skip

    runs = [run("trl_bf16", None, 86.0, 37.0, 38.0, 16.0), run("trl_bf16_liger", None, 71.0, 34.0, 29.0, 16.0),
            run("bf16_defaults", None, 62.0, 32.0, 29.0, 16.0), run("fp8_defaults", "blockwise", 51.0, 25.0, 25.0, 8.3),
            {"name": "unified_fp8kv", "error": "CUDA out of memory"}]  # fmt: skip
    path = tmp_path / "colocate.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "date": "2026-11-29", "results": runs}))
    collect_twins.main([str(path), "--json", str(tmp_path / "ratios.json")])
    (row,) = json.loads((tmp_path / "ratios.json").read_text())["ratios"]
    assert row["run"] == "fp8_defaults" and row["bf16_twin"] == "bf16_defaults"
    assert row["vs TRL BF16"] == 86.0 / 51.0 and row["vs TRL BF16 + Liger"] == 71.0 / 51.0
    assert (row["step vs twin"], row["rollout vs twin"], row["micro-batches vs twin"]) == (62 / 51, 32 / 25, 29 / 25)
    out = capsys.readouterr().out
    assert "| fp8_defaults | 1.69x | 1.39x | 1.22x | 1.28x | 1.16x |" in out
    assert "| fp8_defaults | 51.0 s | 25.0 s (33% of 8.3 s) | 1.0 + 25.0 s |" in out
    assert "| unified_fp8kv | CUDA out of memory |" in out

    # without the twin and TRL BF16 + Liger: only the ratio that has its run
    path.write_text(json.dumps({"results": [runs[0], runs[3]]}))
    collect_twins.main([str(path)])
    assert "| fp8_defaults | 1.69x | - | - | - | - |" in capsys.readouterr().out
