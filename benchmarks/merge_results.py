"""One results file from files of one benchmark whose runs went at the same time on disjoint GPUs of one machine
(a flow or an engine per GPU): the rows side by side, and which ran together.

    python -m benchmarks.merge_results A.json B.json [...] --same settings.shape prompt_len --id_key name --out OUT.json

The files must agree on the device and on every `--same` key (dotted for nested ones, `settings.shape`), or nothing is
written. The merged file is the first file with every file's rows (and `failed_runs` / `failures`, where a benchmark
keeps them), plus `ran_at_once`: each file's row ids, the runs that shared the machine's host at once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import arg_parser, dotted, write_json


def merge_at_once(results: list[dict], same: Sequence[str], id_key: str = "name") -> dict:
    """`results` (parsed files) as one: rows concatenated in order; `ValueError` where they differ in `same` or device."""
    first = results[0]
    for other in results[1:]:
        for key in same:
            if dotted(other, key) != dotted(first, key):
                raise ValueError(f"side-by-side files differ in {key.rpartition('.')[2]}: {dotted(first, key)} vs "
                                 f"{dotted(other, key)}")  # fmt: skip
        if other.get("device") != first.get("device"):
            raise ValueError(f"side-by-side files ran on other GPUs: {first.get('device')} vs {other.get('device')}")
    merged = {**first, "results": [row for r in results for row in r["results"]]}
    if any("failed_runs" in r or "failures" in r for r in results):
        merged["failed_runs"] = [name for r in results for name in r.get("failed_runs", [])]
        merged["failures"] = {name: why for r in results for name, why in r.get("failures", {}).items()}
    merged["ran_at_once"] = [[row[id_key] for row in r["results"]] + r.get("failed_runs", []) for r in results]
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("results", nargs="+", help="results files of one benchmark, run at once")
    parser.add_argument("--same", nargs="*", default=[], help="keys every file must agree on (dotted for nested ones)")
    parser.add_argument(
        "--id_key", default="name", help="the key naming a row (bench_grpo: name, bench_rollout: engine)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    merged = merge_at_once([json.loads(Path(f).read_text()) for f in args.results], args.same, args.id_key)
    write_json(args.out, merged)
    print(f"wrote {args.out}: {' | '.join(', '.join(ids) for ids in merged['ran_at_once'])} at once")


if __name__ == "__main__":
    main()
