"""`trl-fp8 plan` against the GPU memory the benchmarks measured: for every committed GRPO run that the planner can
describe (TRL BF16 or trl-fp8's blockwise FP8 flows, one GPU, DDP or FSDP2, with the expandable segments that
FP8GRPOTrainer and the benchmark harness now use), the planner's peak stays within a few GiB below the device's peak
(nvidia-smi's, which also counts the CUDA context, NCCL's communicators and PyTorch's cached blocks). Before the
planner counted FSDP2's unsharded gradients, the 8B FSDP2 runs on 4 x H100 peaked 14 GiB above it."""

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.bench_rollout import SHAPES
from trl_fp8.cli import plan
from trl_fp8.plan.memory import PlannedRun, flow_row
from trl_fp8.rollout.capacity import GPU_MEMORY_BYTES, GiB, ModelShape

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# The planner's peak may read this far under the device's: what it does not model (CUDA context, cuBLAS workspaces,
# NCCL beyond its assumed 1 GiB, PyTorch's cached blocks). Its fits rule keeps 3% of the GPU free (2.4 GiB of an
# H100) against part of it. The several-process runs committed so far also read GPU 0 for every rank, where each other
# rank's memory sampler held a CUDA context of its own (the benchmark's sampler thread started on GPU 0): the FSDP2
# runs on 4 GPUs, up to three contexts, are the ones nearest this bound (6.2 and 7.2 GiB above the plan).
UNMODELLED_GIB = 7.5


def measured_runs() -> list[tuple[str, dict, dict]]:
    """(file, settings, row) of every committed GRPO run with device peaks, its optimizer modelled by the planner,
    measured with expandable segments, in a flow the planner plans."""
    runs = []
    for path in sorted(RESULTS.glob("grpo*.json")):
        result = json.loads(path.read_text())
        settings = result.get("settings") or {}
        if settings.get("cuda_alloc_conf") != "expandable_segments:True" or settings.get("shape") not in SHAPES:
            continue
        for row in result["results"]:
            bf16 = row.get("trainer") == "trl" and row.get("rollout_precision") == "bf16"
            fp8 = row.get("trainer") == "trl_fp8" and row.get("fp8_recipe") == "blockwise"
            if row.get("peak_device_memory_by_phase_gib") and (bf16 or fp8 and row.get("rollout_precision") == "fp8"):
                runs.append((path.name, {**settings, "device": result["device"]}, row))
    return runs


def recorded_prefetch_layers(row: dict) -> int:
    """The run's FSDP2 prefetch lead: its `FP8Tuning` (`tuning`), or in results written before the tuning had its own
    record, its `fp8_options`."""
    options = {**(row.get("fp8_options") or {}), **(row.get("tuning") or {})}
    return options.get("fsdp2_prefetch_layers") or 1


def planned_peak(settings: dict, row: dict) -> float:
    """The planner's peak per GPU (GiB) for the run, through the CLI's own parser and flow rows."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    config = Qwen3MoeConfig if "num_experts" in SHAPES[settings["shape"]] else Qwen3Config
    shape = ModelShape.from_config(config(**SHAPES[settings["shape"]], head_dim=128))
    processes = settings.get("num_processes") or 1
    launch = "fsdp2" if settings.get("launch_config") == "fsdp2" and processes > 1 else "ddp"
    recorded = row.get("fp8_cache_weights")
    if recorded is None and "fp8_cache_with_grad" not in row and row.get("fp8_weight_cache_gib"):
        recorded = True  # measured before the default cache served scoring only: it stayed through the micro-batches
    cache = {None: "auto", True: "on", False: "off"}[recorded]
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    args = parser.parse_args([
        "model", "--vllm_gpu_memory_utilization", str(settings["vllm_memory"]), "--micro_batch",
        str(settings["micro_batch"]), "--generation_batch", str(settings["generation_batch"]), "--optim",
        settings["optim"], "--num_processes", str(processes), "--launch", launch, "--fp8_cache_weights", cache,
        "--fsdp2_prefetch_layers", str(recorded_prefetch_layers(row)),
        "--vllm_tensor_parallel_size", str(settings.get("vllm_tensor_parallel_size") or 1),
        *(["--sleep_mode"] if settings["sleep_mode"] else []),
        *(["--sync_each_batch"] if settings.get("sync_each_batch") else []),
    ])  # fmt: skip
    total = GPU_MEMORY_BYTES["H200" if "H200" in settings["device"] else "H100"]
    fp8 = row["trainer"] == "trl_fp8"
    seq_len = settings["prompt_len"] + settings["completion_len"]
    _, _, peak, _, _ = flow_row(shape, total, seq_len, PlannedRun.from_cli(args), launch, fp8_weights=fp8,
                                fp8_kv=fp8 and bool(row.get("fp8_kv_cache")), fetch_best=False)  # fmt: skip
    return peak / GiB


RUNS = measured_runs()


def test_the_measured_runs_include_several_gpus_and_both_launches():
    launches = {(s.get("num_processes") or 1, s.get("launch_config")) for _, s, _ in RUNS}
    assert {(2, "multi_gpu"), (4, "multi_gpu"), (4, "fsdp2")} <= launches and len(RUNS) >= 20


@pytest.mark.parametrize(("name", "settings", "row"), RUNS, ids=[f"{n}:{r['name']}" for n, _, r in RUNS])
def test_the_planned_peak_is_within_a_few_gib_of_the_measured_one(name, settings, row):
    measured = max(row["peak_device_memory_by_phase_gib"].values())
    planned = planned_peak(settings, row)
    assert -2.0 <= measured - planned <= UNMODELLED_GIB, f"planned {planned:.1f} GiB, measured {measured:.1f} GiB"
