"""Draw the report's plots from the committed JSON results (CPU, no GPU needed).

    python -m benchmarks.plot_results [--results benchmarks/results] [--out benchmarks/plots]

- `convergence_reward.png`, `convergence_accuracy.png`, `convergence_mismatch.png`: per-step reward, held-out
  accuracy and trainer-vs-rollout mismatch of every `results/convergence*/grpo_*.json` setting (one colour per
  setting, one line style per seed); the studies of their own (`SEPARATE_STUDIES`: `convergence_fp8kv/`, the FP8 KV
  cache's cost) get the same three plots under their folder's name, and a table;
- `rollout_throughput.png`: `results/rollout_<device>.json`, tokens/s per engine (the long regime's profiled
  rollouts, `rollout_long_<device>.json`, get a table);
- `rollout_capacity.png`: `results/rollout_capacity_mem<share>_<device>.json`, tokens/s of each engine against the
  share of the GPU vLLM was given (matched memory; one panel per sequences x new tokens point, the files of one
  device), with each point's floor hollow and dashed;
- `grpo_step_time.png`: `results/grpo_speed_*.json`, step time split into rollout / training / weight sync, each bar
  annotated with its step time and its speed-up over TRL BF16 (the same for the report's other regimes, and
  `grpo_colocate_step_time_<device>.png`, with readable run names, for TRL's colocate defaults, one per GPU,
  `grpo_colocate_8b_<device>.json`);
- `grpo_bestfit_step_time_<device>.png`: `results/grpo_bestfit_8b_<device>.json`, the GRPO step at each vLLM share
  tried for a best fit, the shares that ran out of memory marked;
- `linear_speedup.png`: `results/linear_*.json`, each variant's forward+backward speed-up over BF16 per layer shape.

A plot whose results are missing is skipped (and said so); nothing is invented. The same run also prints the
report's tables (`tables`), which `docs/contributing/benchmark-details.md` and `notebooks/fp8_vs_bf16.ipynb` quote.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import RESULTS, arg_parser, kernel_category

REPORT_DEVICE = "NVIDIA_H200"  # the device of the report (docs/contributing/benchmark-details.md): drawn where one is


def _sorted(paths) -> list[Path]:
    """By name, the report device's files first (other GPUs' results sit beside them, drawn only where alone)."""
    return sorted(paths, key=lambda p: (REPORT_DEVICE not in p.name, p.name))


def _load(paths) -> list[dict]:
    return [json.loads(p.read_text()) for p in _sorted(paths)]


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_convergence(runs: list[dict], out: Path, plt, prefix: str = "convergence") -> list[Path]:
    def steps_with(key):  # 10-step means: the per-step values are noisy
        return lambda r: (
            [s["step"] for s in r["steps"] if key in s],
            _smooth([s[key] for s in r["steps"] if key in s], 10),
        )

    written = []
    panels = [
        (f"{prefix}_reward.png", "reward (10-step mean)", lambda r: ([s["step"] for s in r["steps"]], _smooth([s["reward"] for s in r["steps"]], 10))),
        (f"{prefix}_accuracy.png", "held-out greedy accuracy", lambda r: ([e["step"] for e in r["held_out"]], [e["held_out_accuracy"] for e in r["held_out"]])),
        (f"{prefix}_mismatch.png", "mean |logp_train - logp_rollout| (10-step mean)", steps_with("fp8/mismatch/abs_logp_diff_mean")),
    ]  # fmt: skip
    settings = list(dict.fromkeys(r["setting"]["name"] for r in runs))
    seeds = sorted({r["args"]["seed"] for r in runs})
    for name, ylabel, series in panels:
        fig, ax = plt.subplots(figsize=(7.2, 4.4))
        for run in runs:
            x, y = series(run)
            seed = run["args"]["seed"]
            ax.plot(x, y, color=f"C{settings.index(run['setting']['name'])}", linestyle=["-", "--", ":"][seeds.index(seed) % 3],
                    linewidth=1.2, label=f"{run['setting']['name']} (seed {seed})")  # fmt: skip
        if name.endswith("_mismatch.png"):
            ax.set_yscale("log")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} ({runs[0]['device']})")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)
    return written


def mismatch_by_position(runs: list[dict], stat: str = "abs_logp_diff_mean") -> dict[str, dict[int, float]]:
    """setting -> first completion position of each bucket -> the bucket's mismatch `stat`, the mean over every
    logged step of every seed (`fp8/mismatch/pos_<lo>_<hi>/<stat>`, logged where the bucket held tokens)."""
    sums: dict[str, dict[int, list[float]]] = {}
    for run in runs:
        for step in run["steps"]:
            for key, value in step.items():
                if key.startswith("fp8/mismatch/pos_") and key.endswith(f"/{stat}"):
                    lo = int(key.removeprefix("fp8/mismatch/pos_").split("_")[0])
                    sums.setdefault(run["setting"]["name"], {}).setdefault(lo, []).append(value)
    return {s: {lo: sum(v) / len(v) for lo, v in sorted(b.items())} for s, b in sums.items()}


def plot_mismatch_by_position(runs: list[dict], out: Path, plt, prefix: str) -> Path | None:
    panels = [(stat, label) for stat, label in (("abs_logp_diff_mean", "mean |logp_train - logp_rollout|"),
                                                ("kl_k3", "KL(rollout || train), k3")) if mismatch_by_position(runs, stat)]  # fmt: skip
    if not panels:
        return None
    settings = list(dict.fromkeys(r["setting"]["name"] for r in runs))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.2), squeeze=False)
    for ax, (stat, label) in zip(axes[0], panels, strict=True):
        for setting, buckets in mismatch_by_position(runs, stat).items():
            ax.plot([lo + 1 for lo in buckets], list(buckets.values()), marker="o",
                    color=f"C{settings.index(setting)}", label=setting)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("completion position (first of its bucket, +1)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"Mismatch along the completion, mean over steps and seeds ({runs[0]['device']})")
    fig.tight_layout()
    fig.savefig(out / f"{prefix}_mismatch_by_position.png", dpi=120)
    plt.close(fig)
    return out / f"{prefix}_mismatch_by_position.png"


def rollout_points(result: dict) -> dict[str, dict[str, float]]:
    """`{engine: {"<sequences>x<new tokens>": tokens/s}}` from a bench_rollout result, in either format: rows with
    `points` (since the rollout-kernel issue) or the first format's `gen_<new tokens>` entries."""
    table = {}
    for r in result["results"]:
        if "points" in r:
            table[r["engine"]] = {f"{p['seqs']}x{p['new_tokens']}": p["tokens_per_s"] for p in r["points"]}
        else:
            gens = {k: v for k, v in r.items() if k.startswith("gen_")}
            table[r["engine"]] = {
                f"{v['prompts']}x{k.removeprefix('gen_')}": v["tokens_per_s"] for k, v in gens.items()
            }
    return table


def rollout_result(results: Path) -> dict | None:
    """The rollout benchmark of the report (`rollout_<device>.json`): dated files are earlier runs, and
    `rollout_long_<device>.json` is the long regime's profile (`rollout_profile_table`)."""
    paths = _sorted(p for p in results.glob("rollout_*.json") if not p.name.startswith(("rollout_long_", CAPACITY)))
    return json.loads(paths[0].read_text()) if paths else None


def rollout_profile_table(result: dict) -> list[str]:
    """Per engine of a profiled bench_rollout run (`run_rollout_report.sh kvprofile`): throughput against BF16 and
    its floor, then the profiled rollout's GPU kernel time by category. The categories are recomputed from the
    heaviest kernels the file records with today's `kernel_category` (the file's own may predate a name), and the
    share of the kernel time those kernels cover is shown."""
    rows = [r for r in result["results"] if "profile" in r]
    if not rows:
        return []
    by_engine = {}
    for r in rows:
        ms = {}
        for k in r["profile"]["top_kernels"]:
            category = kernel_category(k["name"])
            ms[category] = ms.get(category, 0.0) + k["ms"]
        by_engine[r["engine"]] = ms
    categories = sorted(
        {c for ms in by_engine.values() for c in ms}, key=lambda c: -max(m.get(c, 0) for m in by_engine.values())
    )
    base = next((r["points"][0]["tokens_per_s"] for r in rows if r["engine"] == "bf16"), None)
    p = rows[0]["profile"]
    lines = [f"Rollouts alone, {result['shape']['name']} shape, {result['device']}: tokens/s at "
             f"{rows[0]['points'][0]['seqs']}x{rows[0]['points'][0]['new_tokens']}, then kernel seconds of a profiled "
             f"{p['seqs']}x{p['new_tokens']} rollout (attention's KV floor in brackets)", "",
             "| engine | tokens/s | vs bf16 | of floor | kernels | " + " | ".join(categories)
             + " | recorded kernels cover |",
             "|---|" + "---|" * (len(categories) + 5)]  # fmt: skip
    for r in rows:
        point, prof, ms = r["points"][0], r["profile"], by_engine[r["engine"]]
        total = sum(prof["kernel_ms_by_category"].values())
        cells = [f"{ms[c] / 1e3:.2f}" if c in ms else "-" for c in categories]
        if "attention" in categories:
            cells[categories.index("attention")] += f" ({prof['attention_kv_floor_ms'] / 1e3:.2f})"
        ratio = f"{point['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['engine']} | {point['tokens_per_s']:.0f} | {ratio} | {point['of_floor']:.0%} | "
                     f"{total / 1e3:.2f} | " + " | ".join(cells) + f" | {sum(ms.values()) / total:.1%} |")  # fmt: skip
    return [*lines, ""]


def plot_rollout(result: dict, out: Path, plt) -> Path:
    table = rollout_points(result)
    engines = list(table)
    labels = list(dict.fromkeys(label for points in table.values() for label in points))
    fig, ax = plt.subplots(figsize=(7.2, 4))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        xs = [j + i * width for j, label in enumerate(labels) if label in table[engine]]
        ax.bar(xs, [table[engine][label] for label in labels if label in table[engine]], width, label=engine)
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_xlabel("concurrent sequences x new tokens")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"vLLM rollout throughput, {result['shape']['name']} shape ({result['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rollout_throughput.png", dpi=120)
    plt.close(fig)
    return out / "rollout_throughput.png"


CAPACITY = "rollout_capacity_mem"  # matched-memory files: one per share of the GPU (`run_rollout_report.sh capacity`)
ENGINE_LABELS = {"bf16": "BF16", "fp8_deepgemm": "FP8 weights", "fp8_deepgemm_kv": "FP8 weights + FP8 KV"}


def capacity_series(results: Path) -> dict[str, dict[str, dict[str, list[tuple[float, float, float]]]]]:
    """`{device: {point: {engine: [(share, tokens/s, floor tokens/s), ...]}}}` from the matched-memory files (rows
    capped with `--max_num_seqs` are the matched-concurrency regime, not drawn here; a file without rows is skipped),
    shares in increasing order; a point without a floor has NaN there."""
    series: dict = {}
    for path in results.glob(f"{CAPACITY}*.json"):
        result = json.loads(path.read_text())
        if result.get("max_num_seqs"):
            continue
        for row in result.get("results") or []:
            for p in row.get("points", []):
                point = series.setdefault(result["device"], {}).setdefault(f"{p['seqs']}x{p['new_tokens']}", {})
                point.setdefault(row["engine"], []).append(
                    (result["gpu_memory_utilization"], p["tokens_per_s"], p.get("floor_tokens_per_s", float("nan")))
                )
    for points in series.values():
        for engines in points.values():
            for values in engines.values():
                values.sort()
    return series


def plot_capacity(device: str, points: dict, out: Path, plt, name: str = "rollout_capacity.png") -> Path:
    fig, axes = plt.subplots(1, len(points), figsize=(5.2 * len(points), 4), squeeze=False)
    for ax, (label, engines) in zip(axes[0], sorted(points.items()), strict=True):
        for i, (engine, values) in enumerate(engines.items()):
            shares, tps, floors = zip(*values, strict=True)
            color = f"C{i}"
            ax.plot(shares, tps, "o-", color=color, label=ENGINE_LABELS.get(engine, engine))
            ax.plot(shares, floors, "o--", color=color, mfc="none", alpha=0.6)  # NaN where a point has no floor
        ax.plot([], [], "o--", color="grey", mfc="none", label="floor (same colour)")
        shares = sorted({share for values in engines.values() for share, _, _ in values})
        ax.set_xticks(shares)
        ax.set_xlim(shares[0] - 0.1, shares[-1] + 0.1)
        ax.set_title(f"{label} (sequences x new tokens)", fontsize=10)
        ax.set_xlabel("vLLM's share of the GPU (gpu_memory_utilization)")
        ax.set_ylabel("output tokens / s (dashed, hollow: floor)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"vLLM rollout tokens/s against vLLM's share of the GPU, matched memory ({device})", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return out / name


RUN_ORDER = (
    "trl_bf16",
    "trl_bf16_liger",
    "fp8_defaults",
    "fp8_defaults_scoring_pass",
    "unified_fp8kv_compiled_liger",
    "fp8_rollout",
    "unified",
    "unified_fp8kv",
    "unified_deepgemm",
    "unified_nocache",
)  # bench_grpo.RUNS, baseline first


RUN_LABELS = {
    "trl_bf16": "TRL BF16",
    "unified": "unified FP8",
    "unified_fp8kv": "unified FP8\n+ FP8 KV",
    "trl_bf16_liger": "TRL BF16\n+ Liger",
    "fp8_defaults": "FP8GRPOTrainer\ndefaults",
    "fp8_defaults_scoring_pass": "defaults,\nscoring pass",
    "unified_fp8kv_compiled_liger": "compiled\n+ Liger",
}
LABELED_STEMS = ("grpo_colocate_step_time",)  # plots read beside prose (docs/when-fp8-pays.md): readable run names


def _speed_rows(result: dict) -> list[dict]:
    return sorted(result["results"], key=lambda r: RUN_ORDER.index(r["name"]) if r["name"] in RUN_ORDER else 99)


# plot stem -> the prefix of bench_grpo's result files it draws
SPEED_FILES = {"grpo_step_time": "grpo_speed_", "grpo_step_time_four": "grpo_speed_four_",
               "grpo_step_time_long": "grpo_speed_long_", "grpo_colocate_step_time": "grpo_colocate_8b_",
               # issue 33: fused / Liger / compiled runs at 64 x 1k, and Liger on both sides at 8B and 1.7B
               "grpo_step_time_train": "grpo_train_8b_", "grpo_step_time_liger": "grpo_liger_8b_",
               "grpo_step_time_liger_1.7b": "grpo_liger_1.7b_"}  # fmt: skip


def speed_results(results: Path) -> list[tuple[str, dict]]:
    """`(plot stem, bench_grpo result)` per set of runs that has a result: the 64 x 1k variants of unified FP8
    (`grpo_speed_<device>.json`; dated files are earlier runs; `grpo_train_8b_`, `grpo_liger_8b_`, `grpo_liger_1.7b_`:
    issue 33's), the report's four flows at 64 x 1k (`four` phase,
    `grpo_speed_four_<device>.json`), in the long regime (`long` phase, `grpo_speed_long_<device>.json`) and at TRL's
    colocate defaults (`grpo_colocate_8b_<device>.json`)."""
    paths = [  # "<device>.json" sorts before "<device>_<date>.json"
        p for p in _sorted(results.glob("grpo_*.json")) if p.name.startswith(tuple(SPEED_FILES.values()))
    ]

    def prefix(path: Path) -> str:  # the longest prefix that names the file
        return max((p for p in SPEED_FILES.values() if path.name.startswith(p)), key=len)

    found = {stem: [p for p in paths if prefix(p) == pre] for stem, pre in SPEED_FILES.items()}
    out = []
    for stem, files in found.items():
        if stem not in PER_DEVICE_STEMS:
            out += [(stem, json.loads(files[0].read_text()))] if files else []
            continue
        by_device: dict[str, dict] = {}  # the first file per GPU ("<device>.json" before dated ones)
        for result in map(json.loads, (p.read_text() for p in files)):
            by_device.setdefault(result["device"], result)
        out += [(f"{stem}_{device.replace(' ', '_')}", result) for device, result in by_device.items()]
    return out


PER_DEVICE_STEMS = ("grpo_colocate_step_time",)  # regimes measured on several GPUs: one plot per GPU


def _regime(result: dict) -> str:
    s = result["settings"]
    sleep = f", vLLM {s['vllm_memory']}, sleep mode" if s.get("sleep_mode") else ""
    return f"{s['shape']} shape, {s['generation_batch']} x {s['completion_len']} tokens{sleep}"


def plot_step_time(result: dict, out: Path, plt, stem: str = "grpo_step_time") -> Path:
    """Stacked rollout / training / weight sync per run, each bar annotated with its step time (median) and, where
    `trl_bf16` ran, its speed-up over it."""
    rows = _speed_rows(result)
    base = next((r["step_time"]["step_s"] for r in rows if r["name"] == "trl_bf16"), None)
    parts = ("rollout_s", "training_s", "weight_sync_s")
    names = [RUN_LABELS.get(r["name"], r["name"]) if stem.startswith(LABELED_STEMS) else r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    bottom = [0.0] * len(rows)
    for part in parts:
        values = [r["step_time"][part] for r in rows]
        ax.bar(names, values, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, (r, total) in enumerate(zip(rows, bottom, strict=True)):
        step = r["step_time"]["step_s"]
        ax.text(i, total, f"{step:.1f} s" + (f", {base / step:.2f}x" if base else ""), ha="center", va="bottom",
                fontsize=8 if len(rows) > 3 else 10)  # fmt: skip
    ax.set_ylim(top=max(bottom) * 1.22)  # room above the bars for the legend, clear of the annotations
    ax.set_ylabel("seconds per GRPO step (median)")
    title = f"GRPO step time, {_regime(result)} ({result['device']}, {result['date']})"
    ax.set_title(title.replace(" (", "\n(", 1) if len(title) > 80 else title, fontsize=10)
    ax.legend(loc="upper center", ncol=len(parts), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    plt.close(fig)
    return out / f"{stem}.png"


def plot_bestfit(result: dict, out: Path, plt) -> Path:
    """`grpo_bestfit_8b_<device>.json` (`collect_bestfit.py`): one bar per flow and vLLM share, stacked as in
    `plot_step_time`; a share that ran out of memory gets a labelled empty slot, not a bar."""
    outcomes = result["results"]
    names = [f"{RUN_LABELS.get(o['name'], o['name'])}\n{o['vllm_memory']:g}"
             f"{', expandable' if 'expandable_segments:True' in o['cuda_alloc_conf'] else ''}" for o in outcomes]  # fmt: skip
    fig, ax = plt.subplots(figsize=(1.6 * len(outcomes) + 1.5, 4.2))
    bottom = [0.0] * len(outcomes)
    for part in ("rollout_s", "training_s", "weight_sync_s"):
        values = [o["row"]["step_time"][part] if o["ran"] else 0.0 for o in outcomes]
        ax.bar(names, values, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    top = max(bottom)
    for i, o in enumerate(outcomes):
        text = f"{o['row']['step_time']['step_s']:.1f} s" if o["ran"] else "out of\nmemory"
        ax.text(i, bottom[i] if o["ran"] else top * 0.05, text, ha="center", va="bottom", fontsize=9,
                color="black" if o["ran"] else "C3")  # fmt: skip
    ax.set_ylim(top=top * 1.22)
    ax.set_ylabel("seconds per GRPO step")
    ax.set_xlabel("flow, vLLM's share of the GPU, PyTorch allocator")
    ax.tick_params(axis="x", labelsize=8)
    s = result["settings"]
    ax.set_title(f"GRPO step at each vLLM share tried, {s['shape']} shape, {s['generation_batch']} x "
                 f"{s['completion_len']} tokens, sleep mode\n({result['device']}, {result['date']})", fontsize=9)  # fmt: skip
    ax.legend(loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout()
    name = f"grpo_bestfit_step_time_{result['device'].replace(' ', '_')}.png"
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return out / name


def linear_speedups(result: dict) -> dict[str, dict[str, float]]:
    """variant -> shape -> speed-up over BF16, for the variants that ran (a failed variant has no time)."""
    table: dict[str, dict[str, float]] = {}
    for row in result["results"]:
        if row["variant"] != "bf16" and "speedup_vs_bf16" in row:
            table.setdefault(row["variant"], {})[row["shape"]] = row["speedup_vs_bf16"]
    return table


def plot_linear(result: dict, out: Path, plt, goal: float = 1.45) -> Path:
    table = linear_speedups(result)
    shapes = list(dict.fromkeys(row["shape"] for row in result["results"]))
    fig, ax = plt.subplots(figsize=(9, 4.4))
    width = 0.8 / len(table)
    for i, (variant, speed) in enumerate(table.items()):
        xs = [j + i * width for j, shape in enumerate(shapes) if shape in speed]
        ax.bar(xs, [speed[shape] for shape in shapes if shape in speed], width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(goal, color="black", linewidth=0.8, linestyle="--", label=f"goal {goal}x")
    ax.set_xticks([j + width * (len(table) - 1) / 2 for j in range(len(shapes))], shapes, fontsize=8)
    ax.set_ylabel("speed-up over BF16, forward+backward")
    ax.set_title(f"Linear layer, M={result['tokens']} tokens, Qwen3-8B shapes ({result['device']}, {result['date']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "linear_speedup.png", dpi=120)
    plt.close(fig)
    return out / "linear_speedup.png"


def _convergence_runs(results: Path, task: str = "addition", folder: str | None = None) -> list[dict]:
    """The runs of `task` in the report's `convergence*/` folders (the studies of their own left out), or in `folder`."""
    paths = (
        results.glob(f"{folder}/grpo_*.json")
        if folder
        else [p for p in results.glob("convergence*/grpo_*.json") if p.parent.name not in SEPARATE_STUDIES]
    )
    runs = [r for r in _load(paths) if r["args"].get("task", "addition") == task]
    return sorted(runs, key=lambda r: (r["args"]["seed"], list(SETTING_ORDER).index(r["setting"]["name"])))


SEPARATE_STUDIES = ("convergence_fp8kv",)  # one question each, settings side by side on one host: own table, plots


SETTING_ORDER = ("bf16", "bf16_fp8rollout", "bf16_fp8rollout_tis", "fp8", "fp8_tis", "fp8_tis_fp8kv")
LONG_TASKS = ("chain", "chain_long")  # the long-completion tasks (`run_grpo.py --task`): their own tables and plots


def tables(results: Path) -> str:
    """The report's tables as Markdown, from the JSON: GRPO step time, the convergence runs and the long regime's
    profiled rollouts."""
    lines = []
    for _, result in speed_results(results):
        rows = {r["name"]: r["step_time"] for r in _speed_rows(result)}
        base = rows.get("trl_bf16")
        lines += [f"GRPO step time, {_regime(result)}, {result['device']}, {result['date']} (median s per step)", "",
                  "| run | step | rollout | training | weight sync | speed-up: step / rollout / training |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, t in rows.items():
            speed = (
                "-"
                if not base
                else " / ".join(f"{base[k] / t[k]:.2f}x" for k in ("step_s", "rollout_s", "training_s"))
            )
            lines.append(f"| {name} | {t['step_s']:.2f} | {t['rollout_s']:.2f} | {t['training_s']:.2f} | "
                         f"{t['weight_sync_s']:.2f} | {speed} |")  # fmt: skip
        lines.append("")
    runs = _convergence_runs(results)
    if runs:
        lines += ["Held-out greedy accuracy (%, 2048 problems) and mismatch (mean of all steps)", "",
                  "| setting | seed | step 0 | step 100 | step 200 | reward, last 20 steps | mean abs dlogp | KL k3 |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in runs:
            acc = {e["step"]: 100 * e["held_out_accuracy"] for e in r["held_out"]}
            last = max(acc)
            steps = r["steps"]
            mean = lambda key, xs=steps: sum(s[key] for s in xs if key in s) / max(1, sum(key in s for s in xs))  # noqa: E731
            lines.append(
                f"| {r['setting']['name']} | {r['args']['seed']} | {acc[0]:.2f} | {acc.get(last // 2, float('nan')):.2f} | "
                f"{acc[last]:.2f} | {mean('reward', steps[-20:]):.3f} | {mean('fp8/mismatch/abs_logp_diff_mean'):.4f} | "
                f"{mean('fp8/mismatch/kl_k3'):.1e} |"
            )  # fmt: skip
    lines += fp8kv_table(_convergence_runs(results, folder="convergence_fp8kv"))
    for task in LONG_TASKS:
        lines += long_task_table(_convergence_runs(results, task), task)
    for result in _load(results.glob("rollout_long_*.json"))[:1]:
        lines += rollout_profile_table(result)
    return "\n".join(lines)


def fp8kv_table(runs: list[dict]) -> list[str]:
    """The FP8 KV cache's cost (`run_rollout_report.sh fp8kv`): per setting, held-out accuracy with one standard error
    at the last evaluation, and the trainer-vs-rollout mismatch over all steps (KL k3 mean and median, the share of
    tokens whose TIS ratio was clipped, mean abs dlogp)."""
    if not runs:
        return []
    n = runs[0]["args"]["eval_problems"]
    lines = [f"The FP8 KV cache's cost ({runs[0]['device']}, {runs[0]['date']}): held-out greedy accuracy (%, {n} "
             "problems, +- one standard error) and trainer-vs-rollout mismatch (all steps)", "",
             "| setting | seed | step 0 | last step | accuracy there | KL k3 mean | KL k3 median | TIS clipped tokens | "
             "mean abs dlogp |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        first, last = r["held_out"][0], r["held_out"][-1]
        acc = last["held_out_accuracy"]
        kl = sorted(s["fp8/mismatch/kl_k3"] for s in r["steps"] if "fp8/mismatch/kl_k3" in s)
        clipped = [
            s["fp8/mismatch/is_ratio_clipped_frac"] for s in r["steps"] if "fp8/mismatch/is_ratio_clipped_frac" in s
        ]
        dlogp = [s["fp8/mismatch/abs_logp_diff_mean"] for s in r["steps"] if "fp8/mismatch/abs_logp_diff_mean" in s]
        lines.append(
            f"| {r['setting']['name']} | {r['args']['seed']} | {100 * first['held_out_accuracy']:.2f} | {last['step']} | "
            f"{100 * acc:.2f} +- {100 * (acc * (1 - acc) / n) ** 0.5:.2f} | {sum(kl) / len(kl):.1e} | "
            f"{kl[len(kl) // 2]:.1e} | "
            + (f"{100 * sum(clipped) / len(clipped):.3f}%" if clipped else "- (no TIS)")
            + f" | {sum(dlogp) / len(dlogp):.4f} |"
        )  # fmt: skip
    return [*lines, ""]


def long_task_table(runs: list[dict], task: str) -> list[str]:
    """Per run of a long-completion task: held-out accuracy at the start, at the last step every run evaluated (runs
    stopped by a lease's deadline end at different steps) and at its own last evaluation, and the mismatch at the start
    and the end of the completions (first and last position bucket, mean of all steps). Then per setting, the mismatch
    in every position bucket, the mean over steps and seeds: does it grow along a completion?"""
    if not runs:
        return []
    common = max(set.intersection(*({e["step"] for e in r["held_out"]} for r in runs)))
    lines = [f"Long completions (`--task {task}`): held-out greedy accuracy (%, {runs[0]['args']['eval_problems']} "
             "problems) and mismatch along the completion (mean abs dlogp, mean of all steps)", "",
             f"| setting | seed | step 0 | step {common} | last step | accuracy there | reward, last 10 steps | "
             "positions 0-63 | last bucket |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        acc = {e["step"]: 100 * e["held_out_accuracy"] for e in r["held_out"]}
        last = max(acc)
        rewards = [s["reward"] for s in r["steps"][-10:]]
        buckets = mismatch_by_position([r]).get(r["setting"]["name"], {})
        start, end = min(buckets, default=0), max(buckets, default=0)  # first and last position bucket
        first, final = (f"{buckets[k]:.2e}" if buckets else "-" for k in (start, end))
        lines.append(f"| {r['setting']['name']} | {r['args']['seed']} | {acc[0]:.2f} | {acc[common]:.2f} | {last} | "
                     f"{acc[last]:.2f} | {sum(rewards) / max(1, len(rewards)):.3f} | {first} | {final} (from {end}) |")  # fmt: skip
    for stat, label in (("abs_logp_diff_mean", "mean abs dlogp"), ("kl_k3", "KL k3")):
        by_setting = mismatch_by_position(runs, stat)
        if not by_setting:
            continue
        bounds = sorted({lo for buckets in by_setting.values() for lo in buckets})
        lines += ["", f"Mismatch along the completion (`--task {task}`), {label} per position bucket, mean over steps "
                  "and seeds", "", "| setting | " + " | ".join(f"from {lo}" for lo in bounds) + " | last / first |",
                  "|---|" + "---|" * (len(bounds) + 1)]  # fmt: skip
        for setting, buckets in by_setting.items():
            cells = " | ".join(f"{buckets[lo]:.2e}" if lo in buckets else "-" for lo in bounds)
            growth = buckets[max(buckets)] / buckets[min(buckets)] if buckets[min(buckets)] else float("nan")
            lines.append(f"| {setting} | {cells} | {growth:.1f}x |")
    return [*lines, ""]


def main(argv=None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = arg_parser(__doc__)
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--out", default=str(RESULTS.parent / "plots"))
    args = parser.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    runs = _convergence_runs(results)
    if runs:
        written += plot_convergence(runs, out, plt)
    else:
        print("no results/convergence*/grpo_*.json: convergence plots skipped")
    for folder in SEPARATE_STUDIES:
        study = _convergence_runs(results, folder=folder)
        written += plot_convergence(study, out, plt, prefix=folder) if study else []
    for task in LONG_TASKS:  # their own curves, and the mismatch along a completion
        long_runs = _convergence_runs(results, task)
        if long_runs:
            written += plot_convergence(long_runs, out, plt, prefix=f"convergence_{task}")
            written += [p for p in [plot_mismatch_by_position(long_runs, out, plt, f"convergence_{task}")] if p]
    rollout = rollout_result(results)
    if rollout:
        written.append(plot_rollout(rollout, out, plt))
    for device, points in sorted(capacity_series(results).items())[:1]:  # one device's shares: the report's H100
        written.append(plot_capacity(device, points, out, plt))
    for stem, result in speed_results(results):
        written.append(plot_step_time(result, out, plt, stem))
    for result in _load(results.glob("grpo_bestfit_*.json")):
        written.append(plot_bestfit(result, out, plt))
    for result in _load(results.glob("linear_*.json"))[:1]:
        written.append(plot_linear(result, out, plt))
    for path in written:
        print(f"wrote {path}")
    print(tables(results))
    return written


if __name__ == "__main__":
    main()
