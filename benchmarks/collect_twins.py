"""FP8's own speed-up told apart from the trainer's: a GRPO step's three ratios from `bench_grpo` results.

    COLOCATE_RUNS="trl_bf16 trl_bf16_liger bf16_defaults fp8_defaults" COLOCATE_GPUS="0 1" \
        bash benchmarks/run_rollout_report.sh colocate
    python -m benchmarks.collect_twins benchmarks/results/grpo_colocate_8b_<device>.json [--json out.json]

`FP8GRPOTrainer`'s defaults bring more than FP8: Liger's kernels, scoring in the training forward, token ids only.
Its BF16 twin, `bf16_defaults` (the same trainer and defaults with `fp8_recipe=None`), has all of that too, so
each FP8 run is given three ratios of step time: against TRL BF16, against TRL BF16 with Liger's kernels, and
against its BF16 twin (FP8's own share), with the same ratio for the rollout and for the training micro-batches,
and each rollout's fraction of its floor. A ratio whose run is missing from the file is left out, never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import arg_parser, write_json

# FP8 run -> its BF16 twin (the same trainer and options, nothing in FP8)
TWINS = {"fp8_defaults": "bf16_defaults", "fp8_defaults_compiled": "bf16_defaults_compiled",
         "fp8_defaults_deepgemm": "bf16_defaults"}  # fmt: skip
REFERENCES = {"vs TRL BF16": "trl_bf16", "vs TRL BF16 + Liger": "trl_bf16_liger"}
PHASES = {"step": "step_s", "rollout": "rollout_s", "micro-batches": "micro_batches_s"}


def ratio(base: dict | None, run: dict, phase: str) -> float | None:
    """`base`'s time over `run`'s for `phase` (`step_time` key): how many times faster `run` is."""
    if base is None or not base.get("step_time", {}).get(phase) or not run["step_time"].get(phase):
        return None
    return base["step_time"][phase] / run["step_time"][phase]


def twin_ratios(results: dict) -> list[dict]:
    """One row per FP8 run that has a twin or a reference in `results` (a `bench_grpo` results file)."""
    runs = {r["name"]: r for r in results["results"] if "step_time" in r}
    rows = []
    for name, run in runs.items():
        twin = runs.get(TWINS.get(name, ""))
        references = {label: runs.get(ref) for label, ref in REFERENCES.items()}
        if run.get("fp8_recipe") is None or (twin is None and not any(references.values())):
            continue
        row = {"run": name, "step_s": run["step_time"]["step_s"], "bf16_twin": twin["name"] if twin else None,
               "rollout_of_floor": run.get("rollout_floor", {}).get("of_floor")}  # fmt: skip
        for label, ref in references.items():
            row[label] = ratio(ref, run, "step_s")
        for phase, key in PHASES.items():
            row[f"{phase} vs twin"] = ratio(twin, run, key)
        rows.append(row)
    return rows


def markdown(results: dict, rows: list[dict]) -> str:
    """The table the docs show: every run of the file, then each FP8 run's ratios."""
    lines = ["| run | step | rollout (of its floor) | scoring + micro-batches |",
             "|---|---|---|---|"]  # fmt: skip
    for r in results["results"]:
        if "step_time" not in r:
            lines.append(f"| {r['name']} | {r.get('error', 'did not run')} | | |")
            continue
        t, floor = r["step_time"], r.get("rollout_floor", {})
        of_floor = f" ({floor['of_floor']:.0%} of {floor['floor_s']:.1f} s)" if floor.get("of_floor") else ""
        lines.append(f"| {r['name']} | {t['step_s']:.1f} s | {t['rollout_s']:.1f} s{of_floor} | "
                     f"{t.get('scoring_s', 0.0):.1f} + {t.get('micro_batches_s', 0.0):.1f} s |")  # fmt: skip

    def x(value):
        return "-" if value is None else f"{value:.2f}x"

    lines += ["", "| FP8 run | vs TRL BF16 | vs TRL BF16 + Liger | vs its BF16 twin: step | rollout | micro-batches |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['run']} | {x(r['vs TRL BF16'])} | {x(r['vs TRL BF16 + Liger'])} | {x(r['step vs twin'])} | "
                     f"{x(r['rollout vs twin'])} | {x(r['micro-batches vs twin'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("results", type=Path, help="a bench_grpo results file (merged, when the runs ran at once)")
    parser.add_argument("--json", type=Path, default=None, help="also write the ratios here")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    rows = twin_ratios(results)
    print(
        f"{results.get('device', '?')}, {results.get('date', '?')}: {results.get('note') or results.get('command', '')}"
    )
    print(markdown(results, rows))
    if args.json:
        write_json(args.json, {"source": str(args.results), "device": results.get("device"),
                               "date": results.get("date"), "ratios": rows})  # fmt: skip


if __name__ == "__main__":
    main()
