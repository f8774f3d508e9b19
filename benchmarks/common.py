"""What the benchmark scripts share: the argument parser they start from, the metadata and writing of their results
files (device, GPU count, package versions, date, command line), one child process per configuration (a vLLM
engine holds on to its GPU state, so each gets a fresh process), `--append` merging, and the kernel-time breakdown
of a torch profile.

The scripts form the `benchmarks` package and run from the repository root as modules, `python -m
benchmarks.bench_grpo ...`; they import each other as `from benchmarks.common import ...`."""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import re
import shlex
import subprocess
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "benchmarks" / "results"  # the committed results files
# Recorded in every results file (None where not installed: no vLLM on a CPU host, say).
PACKAGES = ("torch", "transformers", "trl", "torchao", "vllm", "triton")


def arg_parser(
    doc: str | None,
    *,
    out: str | None = None,
    quick: str | None = None,
    append: bool = False,
    workdir: str | None = None,
) -> argparse.ArgumentParser:
    """The parser a script starts from: its docstring as the help text, and the options the scripts share where
    asked for: `--out` (the results file; `out` says where it goes by default), `--quick` (`quick` says what the
    smoke run does), `--append` (merge into an existing results file) and `--workdir` (its default)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # run as `python -m benchmarks.<script>`
    parser = argparse.ArgumentParser(
        prog=f"python -m {spec.name}" if spec is not None and spec.name.startswith("benchmarks.") else None,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if out is not None:
        parser.add_argument("--out", default=None, help=f"results JSON (default {out})")
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    if append:
        parser.add_argument("--append", action="store_true", help="merge into an existing results file")
    if workdir is not None:
        parser.add_argument("--workdir", default=workdir)
    return parser


def versions(*names: str) -> dict[str, str | None]:
    """Installed versions of `names` (default `PACKAGES`), None for a package not installed."""

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {name: installed(name) for name in names or PACKAGES}


def device_name() -> str:
    """The CUDA device's name ("NVIDIA H200"), or "cpu"."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def command(argv: list[str] | None = None, module: str | None = None) -> str:
    """The command line that ran this script, `python -m <module> <argv>` (default: the running module and its
    arguments)."""
    if module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else None
    program = f"python -m {module}" if module else f"python {sys.argv[0]}"
    return f"{program} {shlex.join(sys.argv[1:] if argv is None else argv)}".strip()


def metadata(device: str | None = None, argv: list[str] | None = None) -> dict:
    """What every results file records about its run: the device (default `device_name()`), the GPUs visible, the
    versions of `PACKAGES` with CUDA's and Python's, the date and the command line."""
    import platform

    import torch

    return {
        "device": device or device_name(),
        "gpus": torch.cuda.device_count(),
        "date": datetime.date.today().isoformat(),
        "versions": {**versions(), "cuda": torch.version.cuda, "python": platform.python_version()},
        "command": command(argv),
    }


def results_path(out: str | Path | None, stem: str, device: str) -> Path:
    """`out`, or by default `benchmarks/results/<stem>_<device>.json` (spaces in the device name as underscores)."""
    return Path(out) if out else RESULTS / f"{stem}_{device.replace(' ', '_')}.json"


def write_json(path: str | Path, data: dict, indent: int = 2) -> Path:
    """Write `data` to `path` (its folder made), through a temporary file so that a run cut off mid-write leaves the
    previous file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    tmp.replace(path)
    return path


def json_lines(text: str) -> list[dict]:
    """The JSON objects a child printed, one per line (TRL's Python-dict log lines are not JSON and are skipped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def module_command(module: str, launcher: list[str] | None = None) -> list[str]:
    """The command that runs `module` (`benchmarks.bench_grpo`) as `python -m` does, under `launcher` if given
    (`accelerate launch ...`, which takes `--module`). The child inherits the working directory: the repository root
    (or a PYTHONPATH naming it) from which this script itself was started."""
    return [*launcher, "--module", module] if launcher else [sys.executable, "-m", module]


FAILURE_TAIL_LINES = 40  # of a failed child's stderr, kept in the results file: why it failed, without the log
FAILURE_ERROR_LINES = 30  # the distinct error lines of both streams (a launcher's summary ends stderr, not the cause)
_ERROR_LINE = re.compile(r"(Error|Exception|Failed:|CUDA error|out of memory|Killed)")
# torchrun's own summary of a failed launch: its lines name no cause
_LAUNCHER_LINE = re.compile(r"(ChildFailedError|error_file|To enable traceback|elastic/multiprocessing)")


def error_lines(*streams: str) -> list[str]:
    """The distinct lines of `streams` that say what went wrong (exceptions, CUDA and vLLM failures), in order, each
    rank's `[rankN]: ` prefix dropped so that the ranks' copies of one error count once."""
    seen: dict[str, None] = {}
    for text in streams:
        for line in text.splitlines():
            line = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())[-500:]
            if _ERROR_LINE.search(line) and not _LAUNCHER_LINE.search(line) and line not in seen:
                seen[line] = None
    return list(seen)[:FAILURE_ERROR_LINES]


def run_child(
    module: str,
    flag: str,
    name: str,
    argv: list[str],
    launcher: list[str] | None = None,
    failure: dict | None = None,
) -> list[dict] | None:
    """Run `python -m module flag name argv...` and return its JSON lines; on failure print its stdout's tail, return
    None and, if `failure` is given, fill it with the exit code, the error lines of both streams (`error_lines`) and
    the last lines of the child's stderr.

    `launcher` replaces the plain interpreter (e.g. `accelerate launch ... --num_processes 2`): then only the main
    process should print JSON. The child's stderr (progress lines, tracebacks) is passed on to ours line by line, so
    a long run's log shows where it is, and its tail is kept: a results file then says why a run failed even where
    the log is gone."""
    cmd = [*module_command(module, launcher), flag, name, *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    tail: collections.deque[str] = collections.deque(maxlen=FAILURE_TAIL_LINES)
    errors: list[str] = []

    def relay() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n")[-500:])  # (a progress bar's carriage returns make one long line)
            if _ERROR_LINE.search(line):
                errors.append(line)

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    stdout = proc.stdout.read()
    returncode = proc.wait()
    relay_thread.join()
    rows = json_lines(stdout)
    if returncode != 0 or not rows:
        print(stdout[-6000:])
        print(f"{name} failed (exit {returncode})", flush=True)
        if failure is not None:
            failure.update(exit=returncode, errors=error_lines("".join(errors), stdout), stderr_tail=list(tail))
        return None
    return rows


def dotted(d: dict, key: str):
    """`d`'s value at a dotted key ("settings.shape": `d["settings"]["shape"]`), None where a part is missing."""
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def previous_rows(out: Path, result: dict, same: tuple[str, ...], id_key: str, rerun: list[str]) -> list[dict]:
    """Rows of an earlier results file to keep under `--append`, those not re-run now. The file must hold the same
    device and `same` keys (dotted for nested ones, "settings.shape"): rows of another regime are refused, not
    dropped, so that no measured row is lost by overwriting the file."""
    if not out.exists():
        return []
    previous = json.loads(out.read_text())
    differ = [f"{key}: {dotted(previous, key)!r} there, {dotted(result, key)!r} now"
              for key in ("device", *same) if dotted(previous, key) != dotted(result, key)]  # fmt: skip
    if differ:
        raise SystemExit(f"--append: {out} was measured otherwise ({'; '.join(differ)}); write to another --out")
    return [row for row in previous["results"] if row[id_key] not in rerun]


def run_all(
    module: str,
    flag: str,
    names: list[str],
    argv: list[str],
    result: dict,
    out: Path,
    id_key: str,
    order: list[str],
    launcher: list[str] | None = None,
) -> list[str]:
    """One child per name (`run_child`), each one's last JSON row appended to `result["results"]` (sorted by
    `order`) and `out` rewritten after every child, so a crash keeps what ran; the names that failed go to
    `result["failed_runs"]` (their exit codes and stderr tails to `result["failures"]`) and are returned."""
    failed = []
    for name in names:
        failure: dict = {}
        rows = run_child(module, flag, name, argv, launcher, failure)
        if rows is None:
            failed.append(name)
            result["failed_runs"] = failed  # in the file too: a table without a run must say it failed, and why
            result.setdefault("failures", {})[name] = failure
            write_json(out, result)
            continue
        result["results"].append(rows[-1])
        result["results"].sort(key=lambda r: order.index(r[id_key]))
        write_json(out, result)
    return failed


def device_kernel_events(prof) -> list:
    """A torch profiler's GPU kernel rows. The CPU-side rows of ops (and of autograd functions) repeat the device
    time of the kernels they launched, so a sum over every row counts each kernel twice; so do the GPU-side
    annotations (`nccl:_all_gather_base` spans its NCCL kernel), which are left out too."""
    return [e for e in prof.key_averages() if _is_gpu_kernel(e)]


def _is_gpu_kernel(event) -> bool:
    """A profiler row (an event or an average of events) of a GPU kernel, not of a GPU-side annotation."""
    import torch

    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


# CUDA kernel names -> where a profiled phase's time goes (first match wins; checked on the names seen on H200:
# flash attention's names hold "cutlass", PyTorch's strided elementwise kernels "gpu_kernel_impl_nocast", and
# cuBLAS's blockwise FP8 GEMMs are nvjet "qqtst" kernels; vLLM's are "cutlass_3x_gemm_fp8_blockwise", and its
# activation quantizers come fused into RMSNorm and SiLU-and-mul, so they must match before "norm").
KERNEL_CATEGORIES = (
    ("communication (NCCL)", r"nccl"),  # FSDP2's gathers and reductions, DDP's all-reduce ("reduce" would be a norm)
    ("fp8 quantization (ours)", r"_act_quant_kernel|_weight_quant_kernel"),
    ("fp8 quantization (vLLM)", r"per_block_quant|per_token_group_quant|scaled_fp8_quant"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("gemm, fp8", r"qqtst|deep_gemm|fp8_gemm|gemm_fp8|scaled_mm"),
    ("gemm, bf16", r"gemm|cutlass|xmma|nvjet|cublas|sm90_"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("softmax / log-probs", r"softmax|logsumexp|cross_entropy|nll|log_prob"),
    ("norms / reductions", r"reduce|norm|rsqrt|mean"),
    ("copies / casts", r"copy|(?<!no)cast|convert|fill|cat_|catarray|index"),
    ("elementwise / fused (triton)", r"elementwise|vectorized|unrolled|triton"),
)


def kernel_category(name: str) -> str:
    """Where a CUDA kernel's time goes, by its name (`KERNEL_CATEGORIES`)."""
    import re

    return next((c for c, pattern in KERNEL_CATEGORIES if re.search(pattern, name.lower())), "other")


def resolve_defaults(args, full: dict, quick: dict) -> dict:
    """A kernel benchmark's shapes and timing settings: the options given, else its full-size (or `--quick`)
    defaults."""
    defaults = quick if args.quick else full
    return {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}


def format_us(x: float) -> str:
    return f"{x:,.1f} us" if x >= 10 else f"{x:.3g} us"


def floor_cell(row: dict) -> str:
    """A kernel benchmark's table cell: microseconds and the share of the floor (FAILED where the output's check
    failed), or why there is no time."""
    if "us" in row:
        flag = "" if row["check"] == "ok" else " FAILED"
        return f"{format_us(row['us'])} ({row['fraction']:.0%} of floor){flag}"
    return "skipped" if "skipped" in row else "error" if "error" in row else "-"


def exit_if_checks_failed(results: list[dict], bound: str, name_key: str, tokens_key: str) -> None:
    """Exit 1 naming every row whose output check failed (`bound`: how the bound reads, e.g. "2^-3 x max|ref|")."""
    failed = [r for r in results if r.get("check") == "FAILED"]
    if failed:
        raise SystemExit(
            f"CHECK FAILED (max err above the bound of {bound}): "
            + "; ".join(
                f"{r[name_key]} at {r[tokens_key]} tokens: {r['max_err']:.3g} > {r['err_bound']:.3g}" for r in failed
            )
        )


def graph_time_us(calls: list, warmup: int, repeats: int, after_capture=None) -> tuple[list[float], object]:
    """Microseconds per call of each of `repeats` replays of one CUDA graph holding `calls` (run once before the
    capture, then warmed up), and the graph (its tensors hold the last replay's outputs). `after_capture` runs once
    the graph is captured, before its first replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # anything compiled or allocated lazily (a workspace), before the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    if after_capture is not None:
        after_capture()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None)
    times = []
    for _ in range(repeats):
        if sleep is not None:  # the GPU busy while the host launches the graph: no launch latency in the timing
            sleep(200_000)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return times, graph


def kernel_breakdown(prof, top: int = 25, rest: str = "rest") -> dict:
    """GPU kernel milliseconds of a profiled phase (a training step, a rollout) by category, the heaviest kernels,
    and how the phase's time splits between kernels and waiting (`kernel_timeline`); where the phase marked the ends
    of its parts (`segment_end`), the same split for each part, the one after the last mark named `rest`; and how far
    the host ran ahead of the GPU (`launch_lag`)."""
    kernels = [e for e in device_kernel_events(prof) if e.self_device_time_total > 0]
    by_category: dict[str, float] = {}
    for e in kernels:
        category = kernel_category(e.key)
        by_category[category] = by_category.get(category, 0.0) + e.self_device_time_total / 1e3
    heaviest = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    out = {
        "kernel_ms_by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {"name": e.key[:160], "ms": e.self_device_time_total / 1e3, "count": e.count} for e in heaviest
        ],
    }
    try:
        events = list(prof.events())
    except (AttributeError, RuntimeError):  # a profiler without its event list
        return out
    intervals = [(e.key, e.time_range.start, e.time_range.end) for e in events if _on_device(e)]
    if intervals:
        begins = sorted(e.time_range.start for e in events if e.name == UNTRACED_BEGIN)
        ends = sorted(e.time_range.end for e in events if e.name == UNTRACED_END)
        untraced = list(zip(begins, ends, strict=False))
        out["timeline"] = kernel_timeline(intervals, untraced=untraced)
        if nccl := nccl_durations(intervals):
            out["nccl_kernels"] = nccl
        marks = sorted(
            (e.time_range.start, e.name[len(SEGMENT_END) :]) for e in events if e.name.startswith(SEGMENT_END)
        )
        if marks:  # each part: the kernels that start after the previous mark and before its own
            bounds = [float("-inf"), *(at for at, _ in marks), float("inf")]
            parts = {}
            for name, lo, hi in zip([*(name for _, name in marks), rest], bounds[:-1], bounds[1:], strict=True):
                if part := [k for k in intervals if lo <= k[1] < hi]:
                    parts[name] = kernel_timeline(part, untraced=untraced)
            out["timeline_parts"] = parts
        out["idle_gaps"] = idle_gaps([(a, b) for _, a, b in intervals] + untraced)  # (left out: not idle)
    if scopes := host_scopes(events):
        out["host_scopes"] = scopes
    if (lag := profile_launch_lag(prof)) is not None:
        out["launch_lag"] = lag
    return out


# The edges (ms) of `idle_gaps`' buckets: a gap of a few microseconds is a kernel launch's own; tens of microseconds
# to a few milliseconds between every decode step is the host preparing the next one; longer ones are stalls.
IDLE_GAP_EDGES_MS = (0.01, 0.1, 1.0, 10.0)


def idle_gaps(spans: list[tuple[float, float]], longest: int = 5) -> dict:
    """The times no kernel runs between a phase's first and last kernel, from its kernels' `(start us, end us)`:
    how many gaps and how many ms fall in each bucket of `IDLE_GAP_EDGES_MS`, and the longest ones (ms, and where
    they start, ms after the first kernel). Many short gaps say the host keeps the GPU waiting at every step, a few
    long ones that something stalled it."""
    gaps, end, first = [], float("-inf"), None
    for a, b in sorted(spans):
        first = a if first is None else first
        if a > end > float("-inf"):
            gaps.append((a - end, end - first))
        end = max(end, b)
    edges = (0.0, *IDLE_GAP_EDGES_MS, float("inf"))
    buckets = {}
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = [g for g, _ in gaps if lo <= g / 1e3 < hi]
        label = f"{lo:g}-{hi:g} ms" if hi != float("inf") else f"over {lo:g} ms"
        buckets[label] = {"count": len(inside), "ms": sum(inside) / 1e3}
    top = sorted(gaps, reverse=True)[:longest]
    return {"buckets": buckets, "longest": [{"ms": g / 1e3, "at_ms": at / 1e3} for g, at in top]}


def host_scopes(events, top: int = 20) -> list[dict]:
    """The host-side annotations of a profile (`record_function` scopes: vLLM's engine and model-runner steps when
    `VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`), each with its calls and total CPU ms, heaviest first; the bench's own
    markers left out."""
    import torch

    totals: dict[str, list] = {}
    for e in events:
        on_host = e.device_type == torch.autograd.DeviceType.CPU
        if not (on_host and getattr(e, "is_user_annotation", False)) or e.name.startswith("bench/"):
            continue
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += (e.time_range.end - e.time_range.start) / 1e3
    heaviest = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"scope": name[:120], "calls": calls, "ms": ms} for name, (calls, ms) in heaviest]


# Markers around what a profiled phase leaves out (bench_grpo: the rollout and the sync inside a training step):
# `untraced_span` puts them in the profile, so the phase's timeline does not count that time as idle.
UNTRACED_BEGIN, UNTRACED_END = "bench/untraced_begin", "bench/untraced_end"
SEGMENT_END = "bench/segment_end:"  # + a part's name: `segment_end` marks where that part of a profiled phase ends


def segment_end(name: str) -> None:
    """Mark the end of part `name` of a profiled phase (after its kernels have finished: synchronize first), so that
    `kernel_breakdown` gives that part a timeline of its own. Nearly free when nothing profiles."""
    import torch

    with torch.profiler.record_function(SEGMENT_END + name):
        pass


def _on_device(event) -> bool:
    """A GPU kernel with a duration (not a GPU-side annotation, which spans kernels already counted)."""
    return _is_gpu_kernel(event) and event.time_range.end > event.time_range.start


# CUDA runtime calls that put a kernel on a stream: a kernel and its launch share a CUPTI correlation id.
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                   "cudaLaunchCooperativeKernel")  # fmt: skip


def spread_ms(ascending: list[float]) -> dict[str, float]:
    """The 10th, 50th and 90th percentiles of values already sorted (the value at that rank, none interpolated)."""
    at = {"p10_ms": 0.1, "median_ms": 0.5, "p90_ms": 0.9}
    return {key: ascending[min(len(ascending) - 1, int(q * len(ascending)))] for key, q in at.items()}


def launch_lag(launches: dict[int, int], kernels: list[tuple[int, int]]) -> dict | None:
    """How far the host runs ahead of the GPU: for each kernel, the time from its launch call on the host to its start
    on the GPU (`launches`: correlation id -> launch ns; `kernels`: (correlation id, start ns)). A GPU with work queued
    starts a kernel long after its launch; one that waits on the host starts it within microseconds, and then
    whatever the host does between launches (Python, hooks) is on the critical path. None without pairs."""
    paired = [(start - launches[corr]) / 1e6 for corr, start in kernels if corr in launches]
    lags = sorted(lag for lag in paired if lag >= 0)  # a kernel cannot start before its launch: a wrong pairing
    if not lags:
        return None
    return {
        "kernels": len(lags),
        "paired_fraction": len(lags) / len(kernels),
        **spread_ms(lags),
        "within_0.1_ms": sum(lag < 0.1 for lag in lags) / len(lags),
        "misordered": len(paired) - len(lags),  # should be 0: else the correlation ids do not pair as assumed
    }


def profile_launch_lag(prof) -> dict | None:
    """`launch_lag` of a torch profiler's kernels, from its Kineto events (None where it has none)."""
    try:
        events = prof.profiler.kineto_results.events()
    except (AttributeError, RuntimeError):
        return None
    import torch

    launches, kernels = {}, []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            if not e.is_user_annotation() and e.duration_ns() > 0:
                kernels.append((e.correlation_id(), e.start_ns()))
        elif e.name() in KERNEL_LAUNCHES:
            launches[e.correlation_id()] = e.start_ns()
    return launch_lag(launches, kernels)


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def nccl_durations(intervals: list[tuple[str, float, float]], longest: int = 10) -> dict | None:
    """The spread of a phase's NCCL kernel durations, from its kernels' `(name, start us, end us)`: a collective's
    kernel runs from its launch on the GPU until every rank has joined and the data has moved, so kernels of one
    size whose durations spread far apart wait on other ranks (or on the GPU's SMs) more than they move data. The
    `longest` with their start (ms after the phase's first kernel). None without NCCL kernels."""
    first = min(a for _, a, _ in intervals)
    nccl = sorted(((b - a) / 1e3, (a - first) / 1e3, name) for name, a, b in intervals
                  if kernel_category(name) == "communication (NCCL)")  # fmt: skip
    if not nccl:
        return None
    return {
        "count": len(nccl),
        **spread_ms([d for d, _, _ in nccl]),
        "longest": [{"ms": d, "at_ms": at, "name": name[:80]} for d, at, name in nccl[::-1][:longest]],
    }


def kernel_timeline(intervals: list[tuple[str, float, float]], untraced: list[tuple[float, float]] = ()) -> dict:
    """How a profiled phase's wall time splits, from its GPU kernels' `(name, start us, end us)`: the span from the
    first kernel's start to the last one's end, less the `untraced` spans inside it (left out of the profile); the
    time some computing kernel runs (streams overlapping counted once); the time NCCL runs, and the part of it during
    which nothing computes (communication the computation does not hide); and the time no kernel runs at all (the GPU
    waiting on the host, or on another rank). In ms."""
    compute, comm = [], []
    for name, a, b in intervals:  # (each name classified once: a whole step has tens of thousands of kernels)
        (comm if kernel_category(name) == "communication (NCCL)" else compute).append((a, b))
    first, last = min(a for _, a, _ in intervals), max(b for _, _, b in intervals)
    left_out = _union_us([(max(a, first), min(b, last)) for a, b in untraced if min(b, last) > max(a, first)])
    span = last - first - left_out
    busy_compute, busy_any = _union_us(compute), _union_us(compute + comm)
    return {
        "span_ms": span / 1e3,
        "compute_busy_ms": busy_compute / 1e3,
        "nccl_busy_ms": _union_us(comm) / 1e3,
        "nccl_exposed_ms": (busy_any - busy_compute) / 1e3,
        "idle_ms": (span - busy_any) / 1e3,
    }


@contextlib.contextmanager
def untraced_span(prof, activities):
    """Leave what runs inside out of `prof` (None: no profile), marking where it was (`UNTRACED_BEGIN/END`)."""
    if prof is None:
        yield
        return
    import torch

    torch.cuda.synchronize()  # the kernels launched before belong to the phase, and end before the mark
    with torch.profiler.record_function(UNTRACED_BEGIN):
        pass
    prof.toggle_collection_dynamic(False, activities)
    try:
        yield
    finally:
        torch.cuda.synchronize()
        prof.toggle_collection_dynamic(True, activities)
        with torch.profiler.record_function(UNTRACED_END):
            pass
