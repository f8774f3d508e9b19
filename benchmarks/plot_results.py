"""Draw the report's plots from the committed JSON results (CPU, no GPU needed).

    python benchmarks/plot_results.py [--results benchmarks/results] [--out benchmarks/plots]

- `convergence_reward.png`, `convergence_accuracy.png`, `convergence_mismatch.png`: per-step reward, held-out
  accuracy and trainer-vs-rollout mismatch of every `results/convergence/grpo_*.json` setting;
- `rollout_throughput.png`: `results/rollout_*.json`, tokens/s per engine;
- `grpo_step_time.png`: `results/grpo_speed_*.json`, step time split into rollout / training / weight sync.

A plot whose results are missing is skipped (and said so); nothing is invented.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(paths) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(paths)]


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_convergence(runs: list[dict], out: Path, plt) -> list[Path]:
    written = []
    panels = [
        ("convergence_reward.png", "reward (5-step mean)", lambda r: ([s["step"] for s in r["steps"]], _smooth([s["reward"] for s in r["steps"]]))),
        ("convergence_accuracy.png", "held-out greedy accuracy", lambda r: ([e["step"] for e in r["held_out"]], [e["held_out_accuracy"] for e in r["held_out"]])),
        ("convergence_mismatch.png", "mean |logp_train - logp_rollout|", lambda r: ([s["step"] for s in r["steps"] if "fp8/mismatch/abs_logp_diff_mean" in s], [s["fp8/mismatch/abs_logp_diff_mean"] for s in r["steps"] if "fp8/mismatch/abs_logp_diff_mean" in s])),
    ]  # fmt: skip
    for name, ylabel, series in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for run in runs:
            x, y = series(run)
            ax.plot(x, y, label=run["setting"]["name"])
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} ({runs[0]['device']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(out / name)
    return written


def plot_rollout(result: dict, out: Path, plt) -> Path:
    rows = result["results"]
    keys = [k for k in rows[0] if k.startswith("gen_")]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r[key]["tokens_per_s"] for r in rows], width, label=key)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(rows))], [r["engine"] for r in rows])
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"vLLM rollout throughput, {result['shape']['name']} shape ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rollout_throughput.png", dpi=120)
    plt.close(fig)
    return out / "rollout_throughput.png"


def plot_step_time(result: dict, out: Path, plt) -> Path:
    rows = result["results"]
    parts = ("rollout_s", "training_s", "weight_sync_s")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    bottom = [0.0] * len(rows)
    for part in parts:
        values = [r["step_time"][part] for r in rows]
        ax.bar([r["name"] for r in rows], values, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("seconds per GRPO step (median)")
    ax.set_title(f"GRPO step time ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "grpo_step_time.png", dpi=120)
    plt.close(fig)
    return out / "grpo_step_time.png"


def main(argv=None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--out", default=str(HERE / "plots"))
    args = parser.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    runs = _load((results / "convergence").glob("grpo_*.json"))
    if runs:
        written += plot_convergence(runs, out, plt)
    else:
        print("no results/convergence/grpo_*.json: convergence plots skipped")
    for result in _load(results.glob("rollout_*.json"))[:1]:
        written.append(plot_rollout(result, out, plt))
    for result in _load(results.glob("grpo_speed_*.json"))[:1]:
        written.append(plot_step_time(result, out, plt))
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
