"""Gather `bench_grpo` runs on 1, 2 and 4 GPUs into one scaling table: FP8 against TRL BF16 at each launch and GPU
count, and each flow's weak-scaling efficiency.

    python -m benchmarks.collect_scaling RESULT.json [RESULT.json ...] --out benchmarks/results/grpo_scaling_8b_<device>.json

Each input is one `benchmarks.bench_grpo` results file (`--num_processes N --launch_config multi_gpu|fsdp2`), all
with the same per-GPU workload (shape, prompt and completion lengths, completions per GPU, vLLM share, sleep mode);
the optimizer may differ by launch (bitsandbytes' 8-bit AdamW does not run under FSDP2). A speed-up is taken only
between the flows of one file, which ran side by side; the weak-scaling efficiency of a flow at N GPUs is its
completions per second over N times its own on one GPU (1.0: N GPUs do N times the work in the same time).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import arg_parser, command, write_json

BASELINE = "trl_bf16"  # TRL's own GRPOTrainer: every speed-up is against it
# The settings every input must share (the per-GPU workload); bench_grpo records them under "settings".
WORKLOAD = ("shape", "prompt_len", "completion_len", "generation_batch", "num_generations", "micro_batch",
            "vllm_memory", "sleep_mode")  # fmt: skip
LAUNCHES = {"multi_gpu": "DDP", "fsdp2": "FSDP2"}


def launch_of(settings: dict) -> tuple[str, int]:
    """`(launch, GPUs)` of a results file: one GPU is its own launch."""
    n = int(settings.get("num_processes", 1))
    return ("1 GPU" if n == 1 else LAUNCHES.get(settings.get("launch_config"), settings.get("launch_config"))), n


def collect(results: list[dict]) -> dict:
    """The scaling table of `results` (bench_grpo results files, read), with each row's speed-up and efficiency."""
    if not results:
        raise ValueError("no results files given")
    workload = {key: results[0]["settings"].get(key) for key in WORKLOAD}
    for result in results[1:]:
        other = {key: result["settings"].get(key) for key in WORKLOAD}
        if other != workload:
            diff = {k: (workload[k], other[k]) for k in WORKLOAD if workload[k] != other[k]}
            raise ValueError(f"the results files run other per-GPU workloads: {diff}")
    rows = []
    for result in results:
        launch, gpus = launch_of(result["settings"])
        by_name = {row["name"]: row for row in result["results"]}
        baseline = by_name.get(BASELINE)
        for name, row in by_name.items():
            step = row["step_time"]
            rows.append({
                "flow": name, "launch": launch, "gpus": gpus, "optim": result["settings"].get("optim"),
                "step_s": step["step_s"], "rollout_s": step["rollout_s"], "training_s": step["training_s"],
                "completions_per_s": row["completions_per_s"],
                "speedup_vs_trl_bf16": baseline["step_time"]["step_s"] / step["step_s"] if baseline else None,
                "device": result.get("device"), "date": result.get("date"),
            })  # fmt: skip
    single = {row["flow"]: row["completions_per_s"] for row in rows if row["gpus"] == 1}
    for row in rows:
        one = single.get(row["flow"])
        row["weak_scaling_efficiency"] = row["completions_per_s"] / (row["gpus"] * one) if one else None
    rows.sort(key=lambda r: (r["gpus"], r["launch"], r["flow"] != BASELINE, r["flow"]))
    return {"workload": workload, "rows": rows}


def table(scaling: dict) -> str:
    """The scaling table as Markdown."""

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = ["| GPUs | launch | flow | optimizer | step s | rollout s | training s | completions/s | vs TRL BF16 | "
             "weak scaling |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in scaling["rows"]:
        lines.append(f"| {r['gpus']} | {r['launch']} | {r['flow']} | {r['optim']} | {r['step_s']:.1f} | "
                     f"{r['rollout_s']:.1f} | {r['training_s']:.1f} | {r['completions_per_s']:.2f} | "
                     f"{num(r['speedup_vs_trl_bf16'], '.2f')}x | {num(r['weak_scaling_efficiency'], '.2f')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("results", nargs="+", help="bench_grpo results files")
    parser.add_argument("--out", required=True, help="the scaling results file to write")
    args = parser.parse_args(argv)
    inputs = [json.loads(Path(p).read_text()) for p in args.results]
    scaling = collect(inputs)
    devices = sorted({r.get("device") for r in inputs if r.get("device")})
    out = {"benchmark": "GRPO weak scaling, vLLM colocated on every GPU", "devices": devices,
           "versions": inputs[0].get("versions"), "command": command(argv, __spec__.name if __spec__ else None),
           "inputs": [str(p) for p in args.results], **scaling}  # fmt: skip
    write_json(args.out, out)
    print(table(scaling))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
