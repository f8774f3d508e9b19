"""Gather `run_rollout_report.sh bestfit` runs into one results file, failures included.

    python -m benchmarks.collect_bestfit WORK_DIR [WORK_DIR ...] --out benchmarks/results/grpo_bestfit_8b_<device>.json

Each bestfit run is one `benchmarks.bench_grpo` call at one vLLM share (`grpo_bestfit_<run>_mem<share>_<device>.json`); a
run that ran out of memory writes no row, so its outcome comes from the work folder's `status.txt`
(`bestfit_<run>_<share> rc=N`) and the last error line of its log (`bestfit_<run>_<share>.log`). A folder is one
host's session: its runs share the allocator setting (`PYTORCH_CUDA_ALLOC_CONF`) recorded in its rows, or given
with `--cuda_alloc_conf DIR=VALUE` for a folder whose runs all failed or predate that record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.common import arg_parser, command, write_json

STATUS = re.compile(r"^bestfit_(?P<run>\w+?)_(?P<share>\d\.\d+) rc=(?P<rc>\d+)")


def error_line(log: Path) -> str | None:
    """The log's last line naming an error (vLLM's wake-up OOM reads `RuntimeError: CUDA Error: out of memory`)."""
    if not log.exists():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if "Error" in line]
    return lines[-1].removeprefix("[rank0]: ").strip() if lines else None


def collect(folder: Path, cuda_alloc_conf: str | None = None) -> tuple[list[dict], dict | None]:
    """`(outcomes, one bench_grpo result for the header)` of the bestfit runs of one work folder, in run order."""
    outcomes, header = [], None
    for line in (folder / "status.txt").read_text().splitlines():
        if not (m := STATUS.match(line)):
            continue
        run, share, rc = m["run"], float(m["share"]), int(m["rc"])
        files = list(folder.glob(f"grpo_bestfit_{run}_mem{m['share']}_*.json"))
        result = json.loads(files[0].read_text()) if files and rc == 0 else {}
        rows = result.get("results") or []
        if rows:
            header = result
        outcomes.append({
            "name": run,
            "vllm_memory": share,
            "ran": bool(rows),
            "error": None if rows else error_line(folder / f"bestfit_{run}_{m['share']}.log"),
            "row": rows[0] if rows else None,
        })  # fmt: skip
    recorded = header["settings"].get("cuda_alloc_conf") if header else None  # the same for the folder's runs
    for outcome in outcomes:
        outcome["cuda_alloc_conf"] = recorded if recorded is not None else cuda_alloc_conf or ""
    return outcomes, header


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cuda_alloc_conf", action="append", default=[], help="DIR=VALUE for a folder's runs")
    args = parser.parse_args(argv)
    confs = dict(item.split("=", 1) for item in args.cuda_alloc_conf)
    outcomes, header = [], None
    for folder in args.folders:
        found, first = collect(folder, confs.get(str(folder)))
        outcomes += found
        header = header or first
    if header is None:
        raise SystemExit("no bestfit run ran: nothing to take the device and versions from")
    settings = {k: v for k, v in header["settings"].items() if k not in ("vllm_memory", "cuda_alloc_conf")}
    result = {  # the runs' device, GPUs, date and versions; the command that gathered them
        "benchmark": "GRPO best fit: the largest vLLM share with which a step runs (run_rollout_report.sh bestfit)",
        **{key: header[key] for key in ("device", "gpus", "date", "versions") if key in header},
        "command": command(argv, __spec__.name),
        "settings": settings,
        "results": outcomes,
    }
    write_json(args.out, result, indent=1)
    for o in outcomes:
        print(o["name"], o["vllm_memory"], o["cuda_alloc_conf"] or "default allocator",
              f"{o['row']['step_time']['step_s']:.1f} s" if o["ran"] else o["error"])  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
