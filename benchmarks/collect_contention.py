"""Gather `run_rollout_report.sh contention` runs (the same one-GPU run on every GPU of a machine at once) into one
results file, with every GPU's clocks, power and temperature while they ran.

    python -m benchmarks.collect_contention grpo_contention_<run>_gpu*_<device>.json --clocks contention_gpu_clocks.csv \
        --out benchmarks/results/grpo_contention_8b_<device>.json

Each input is one `benchmarks.bench_grpo` call on one GPU; the clocks file is `nvidia-smi --query-gpu=timestamp,index,
clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv -l 1`. A slowdown that every copy shows
beside the same run alone is the machine's (its host, or its power and heat: the clocks tell which), not NCCL's.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

from benchmarks.common import arg_parser, command, write_json

BUSY_UTILIZATION = 50  # percent: the samples that count as a GPU at work


def _number(text: str) -> float:
    return float(text.strip().split()[0])


def clock_summary(path: Path) -> dict[str, dict]:
    """Per GPU (by `nvidia-smi` index): the SM clock and power draw over the samples with the GPU at work (median,
    lowest / highest), and the hottest temperature."""
    samples: dict[int, list[tuple[float, float, float, float]]] = {}
    with path.open() as f:
        for row in csv.reader(f):
            try:
                index = int(row[1])
                sm, power, temp, util = (_number(row[column]) for column in (2, 4, 5, 6))
            except (IndexError, ValueError):
                continue  # the header, or a line cut off when the logger was stopped
            samples.setdefault(index, []).append((sm, power, temp, util))
    out = {}
    for index, rows in sorted(samples.items()):
        busy = [r for r in rows if r[3] >= BUSY_UTILIZATION]
        out[str(index)] = {
            "samples": len(rows),
            "busy_samples": len(busy),
            "sm_clock_mhz_busy": _spread([r[0] for r in busy]),
            "power_w_busy": _spread([r[1] for r in busy]),
            "temperature_c_max": max(r[2] for r in rows),
        }
    return out


def _spread(values: list[float]) -> dict | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="one bench_grpo results file per GPU")
    parser.add_argument("--clocks", type=Path, help="the nvidia-smi log taken while they ran")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows, header = [], None
    for path in args.runs:
        gpu = re.search(r"_gpu(\d+)_", path.name)
        try:
            result = json.loads(path.read_text())
            row = result["results"][0]
        except (OSError, ValueError, KeyError, IndexError):
            print(f"{path}: no result")
            continue
        header = header or result
        rows.append({"gpu": int(gpu[1]) if gpu else None, **row})
    if header is None:
        raise SystemExit("no contention run wrote a result: nothing to gather")
    result = {
        "benchmark": "the same one-GPU GRPO run on every GPU of one machine at once (run_rollout_report.sh contention)",
        **{key: header[key] for key in ("device", "gpus", "date", "versions") if key in header},
        "command": command(argv, __spec__.name),
        "runs_command": header.get("command"),
        "settings": header.get("settings"),
        "results": rows,
        "gpu_clocks": clock_summary(args.clocks) if args.clocks and args.clocks.exists() else None,
    }
    write_json(args.out, result, indent=1)
    for row in rows:
        t = row["step_time"]
        print(f"GPU {row['gpu']}: step {t['step_s']:.1f} s, rollout {t['rollout_s']:.1f} s, "
              f"training {t['training_s']:.1f} s")  # fmt: skip
    for index, clocks in (result["gpu_clocks"] or {}).items():
        sm, power = clocks["sm_clock_mhz_busy"], clocks["power_w_busy"]
        if sm and power:
            print(
                f"GPU {index} at work: SM clock {sm['median']:.0f} MHz (lowest {sm['min']:.0f}), power "
                f"{power['median']:.0f} W (highest {power['max']:.0f}), hottest {clocks['temperature_c_max']:.0f} C"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
