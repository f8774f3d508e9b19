"""Gather `bench_grpo` runs on 1, 2 and 4 GPUs into one scaling table: FP8 against TRL BF16 at each launch and GPU
count, and each flow's weak-scaling efficiency.

    python -m benchmarks.collect_scaling RESULT.json [RESULT.json ...] --out benchmarks/results/grpo_scaling_8b_<device>.json \
        [--plot benchmarks/plots/grpo_scaling_8b.png]

Each input is one `benchmarks.bench_grpo` results file (`--num_processes N --launch_config multi_gpu|fsdp2`), or several
joined by `+` (`bf16.json+fp8.json`): flows that ran at the same time on disjoint GPUs of one machine (same launch, GPU
count, GPU model and workload), taken as one side-by-side file. All inputs have the same per-GPU workload (shape, prompt
and completion lengths, completions per GPU, vLLM share, sleep mode); the optimizer may differ by launch (bitsandbytes'
8-bit AdamW does not run under FSDP2). A speed-up is taken only between the flows of one file, which ran side by side;
the weak-scaling efficiency of a flow at N GPUs is its completions per second over N times its own on one GPU (1.0: N
GPUs do N times the work in the same time). A run that failed (bench_grpo's `failed_runs`: out of memory, a crash) gets
a row marked failed, without figures.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.common import arg_parser, command, write_json
from benchmarks.merge_results import merge_at_once

BASELINE = "trl_bf16"  # TRL's own GRPOTrainer: every speed-up is against it
# The settings every input must share (the per-GPU workload); bench_grpo records them under "settings".
WORKLOAD = ("shape", "prompt_len", "completion_len", "generation_batch", "num_generations", "micro_batch",
            "vllm_memory", "sleep_mode")  # fmt: skip
LAUNCHES = {"multi_gpu": "DDP", "fsdp2": "FSDP2"}


def launch_of(settings: dict) -> tuple[str, int]:
    """`(launch, GPUs)` of a results file: one GPU is its own launch."""
    n = int(settings.get("num_processes", 1))
    launch = "1 GPU" if n == 1 else LAUNCHES.get(settings.get("launch_config"), settings.get("launch_config"))
    if (tp := settings.get("vllm_tensor_parallel_size", 1)) > 1:
        launch += f", vLLM TP={tp}"
    if settings.get("sync_each_batch"):
        launch += ", sync_each_batch"
    if settings.get("cpu_affinity"):
        launch += ", CPU affinity"
    return launch, n


def merge_side_by_side(results: list[dict]) -> dict:
    """One results file from files whose flows ran at the same time on disjoint GPUs of one machine."""
    keys = [f"settings.{key}" for key in (*WORKLOAD, "num_processes", "launch_config")]
    return merge_at_once(results, keys, id_key="name")


def rank_rollouts(row: dict, settings: dict) -> list[float] | None:
    """Each rank's rollout seconds (its own engine), the median over the steps the row's figures take, or None for
    one process or a row from before ranks were recorded. A spread tells one slow rank from all ranks slower."""
    ranks = row.get("by_rank")
    if not ranks:
        return None
    keep = settings["median_steps"]  # the steps whose medians the row reports
    return [statistics.median(rank["per_step"]["rollout_s"][i] for i in keep) for rank in ranks]


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
                "rollout_s_by_rank": rank_rollouts(row, result["settings"]),
                "completions_per_s": row["completions_per_s"],
                "speedup_vs_trl_bf16": baseline["step_time"]["step_s"] / step["step_s"] if baseline else None,
                "device": result.get("device"), "date": result.get("date"), "failed": False,
            })  # fmt: skip
        for name in result.get("failed_runs", []):
            rows.append({"flow": name, "launch": launch, "gpus": gpus, "optim": result["settings"].get("optim"),
                         "step_s": None, "rollout_s": None, "training_s": None, "completions_per_s": None,
                         "rollout_s_by_rank": None, "speedup_vs_trl_bf16": None, "device": result.get("device"),
                         "date": result.get("date"), "failed": True,
                         "failure": result.get("failures", {}).get(name)})  # fmt: skip
    single = {row["flow"]: row["completions_per_s"] for row in rows if row["gpus"] == 1 and not row["failed"]}
    for row in rows:
        one = single.get(row["flow"])
        done = not row["failed"]
        row["weak_scaling_efficiency"] = row["completions_per_s"] / (row["gpus"] * one) if one and done else None
    rows.sort(key=lambda r: (r["gpus"], r["launch"], r["flow"] != BASELINE, r["flow"]))
    return {"workload": workload, "rows": rows}


def table(scaling: dict) -> str:
    """The scaling table as Markdown."""

    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    def speedup(value) -> str:  # (no TRL BF16 beside the flow: no ratio, rather than "-x")
        return "-" if value is None else f"{value:.2f}x"

    def spread(values) -> str:  # each rank's own rollout, fastest to slowest
        return "-" if not values else f"{min(values):.1f}-{max(values):.1f}"

    lines = ["| GPUs | launch | flow | optimizer | step s | rollout s | rollout s by rank | training s | completions/s | "
             "vs TRL BF16 | weak scaling |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in scaling["rows"]:
        if r["failed"]:
            lines.append(f"| {r['gpus']} | {r['launch']} | {r['flow']} | {r['optim']} | failed | | | | | | |")
            continue
        lines.append(f"| {r['gpus']} | {r['launch']} | {r['flow']} | {r['optim']} | {r['step_s']:.1f} | "
                     f"{r['rollout_s']:.1f} | {spread(r.get('rollout_s_by_rank'))} | {r['training_s']:.1f} | "
                     f"{r['completions_per_s']:.2f} | {speedup(r['speedup_vs_trl_bf16'])} | "
                     f"{num(r['weak_scaling_efficiency'], '.2f')} |")  # fmt: skip
    return "\n".join(lines)


def plot(scaling: dict, path: Path) -> None:
    """Step time (left) and weak-scaling efficiency (right) of each flow and launch against the GPU count; failed runs
    are marked with an x at the bottom of the step-time panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (steps, efficiency) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["flow"], r["launch"] if r["gpus"] > 1 else "DDP") for r in scaling["rows"]})
    for flow, launch in series:
        mine = [r for r in scaling["rows"] if r["flow"] == flow and (r["launch"] == launch or r["gpus"] == 1)]
        done = sorted((r["gpus"], r["step_s"], r["weak_scaling_efficiency"]) for r in mine if not r["failed"])
        label = f"{flow} ({launch})"
        if done:
            line = steps.plot([d[0] for d in done], [d[1] for d in done], marker="o", label=label)[0]
            scaled = [(d[0], d[2]) for d in done if d[2] is not None]
            efficiency.plot([g for g, _ in scaled], [e for _, e in scaled], marker="o", color=line.get_color())
        failed = [r["gpus"] for r in mine if r["failed"]]
        if failed:
            steps.scatter(failed, [0] * len(failed), marker="x", s=80, label=f"{label}: failed")
    w = scaling["workload"]
    steps.set(xlabel="GPUs", ylabel="GRPO step (s)", title=f"{w['shape']}, {w['generation_batch']} x "
              f"{w['completion_len']} tokens per GPU")  # fmt: skip
    efficiency.set(xlabel="GPUs", ylabel="weak-scaling efficiency", ylim=(0, 1.1), title="vs the flow's one GPU")
    efficiency.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    for ax in (steps, efficiency):
        ax.set_xticks(sorted({r["gpus"] for r in scaling["rows"]}))
    steps.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("results", nargs="+", help="bench_grpo results files")
    parser.add_argument("--out", required=True, help="the scaling results file to write")
    parser.add_argument("--plot", default=None, help="also draw the step times and efficiencies to this PNG")
    args = parser.parse_args(argv)
    inputs = [merge_side_by_side([json.loads(Path(f).read_text()) for f in p.split("+")]) for p in args.results]
    scaling = collect(inputs)
    devices = sorted({r.get("device") for r in inputs if r.get("device")})
    out = {"benchmark": "GRPO weak scaling, vLLM colocated on every GPU", "devices": devices,
           "versions": inputs[0].get("versions"), "command": command(argv, __spec__.name if __spec__ else None),
           "inputs": [str(p) for p in args.results], **scaling}  # fmt: skip
    write_json(args.out, out)
    print(table(scaling))
    print(f"wrote {args.out}")
    if args.plot:
        plot(scaling, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
