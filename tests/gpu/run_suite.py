"""The GPU suite in one command, spread over the GPUs of one machine.

    python tests/gpu/run_suite.py [--gpus 0,1,2,3] [--logs DIR] [--lanes-per-gpu N] [--allow-all-skipped]
                                  [paths or pytest options ...]

Tests that need several GPUs (`@pytest.mark.gpus(n)`) run first, each in a pytest process of its own on n GPUs (two
two-GPU tests side by side on four GPUs). Then the one-GPU tests, split into one pytest process per GPU by their
recorded durations (`tests/gpu/durations.json`; every run writes fresh ones to its log folder). On one GPU that is a
single pytest process, and tests needing more GPUs report themselves skipped. `--lanes-per-gpu 2` runs two one-GPU
processes on each GPU at once (the tests ask their engines for 0.25 of a GPU each); a multi-GPU test still has its GPUs
to itself. Sharing a GPU upsets one check of vLLM's: an engine starting while the other process frees memory stops
("Error in memory profiling"), and one starting while the other takes memory finds none left for its KV cache ("No
available memory for the cache blocks"). So processes that share a GPU give each engine a KV cache of a fixed size (8
GiB; a vLLM plugin, `shared_gpu_kv_cache.py`), which vLLM does not measure; one process per GPU keeps vLLM's own sizing.
Should the check fail all the same, the tests that failed so, and only those, run again at the end, one process per GPU,
and the summary counts their second run and says how many there were. A lane whose every failure was that check but
which stopped early (`-x`, `--maxfail`) has the tests it never reached run alone with them. Each process writes its log
and JUnit file to the log folder, and what its tests keep (`TRL_FP8_ARTIFACTS`: vLLM server logs, a run's log history)
to `<process>_artifacts/` there, unless that variable names a folder already; the last line sums them up, as pytest's
own summary does.

Paths and pytest options select the tests as they would for pytest (collection uses them too). The suite passes only
if every process ended well and every test it planned has a result in a JUnit file: a process is forgiven its
failures only when it exited 1 (tests failed), each failure was vLLM's memory check and ran again alone, and each of
its tests is in its JUnit file or was run alone. It fails when the paths and options select no GPU test (a `-k`
typo), when a planned test never ran (a process stopped by `-x`/`--maxfail` on a real failure, or one that crashed),
and when every test skipped (no SM90 GPU, no vLLM: the reasons are printed, grouped) unless `--allow-all-skipped`
is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from visible_gpus import visible_gpus  # noqa: E402 (the GPUs as tests/conftest.py reads them)

sys.path.insert(0, str(Path(__file__).parent))
from shared_gpu_kv_cache import KV_CACHE_BYTES_ENV  # noqa: E402

DURATIONS = Path(__file__).with_name("durations.json")
POLL_S = 2.0  # how often the runner looks for processes that ended
UNKNOWN_TEST_SECONDS = 60.0  # a test with no recorded duration (new, or renamed) is planned at this
# live_report (tests/live_report.py): each test's end and a failure's report at once, so a run cut short still says why
PYTEST = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-p", "live_report", "-s", "-rfEs",
          "--durations=10"]  # fmt: skip


@dataclass
class Job:
    """One pytest process: its tests (node ids) and how many GPUs it takes."""

    name: str
    tests: list[str]
    gpus: int
    expected_s: float
    assigned: list[str] = field(default_factory=list)


# pytest options whose value may come as the next argument (`--deselect ID`, `-k EXPR`): that value is no path.
VALUE_OPTIONS = {"-k", "-m", "-p", "-o", "-W", "--deselect", "--ignore", "--ignore-glob", "--maxfail", "--timeout",
                 "--durations", "--override-ini", "--pythonwarnings", "--rootdir", "--basetemp"}  # fmt: skip


def split_arguments(rest: list[str]) -> tuple[list[str], list[str]]:
    """`(paths, pytest options)` of the arguments after run_suite's own: an option's separate value stays with it."""
    paths, options, i = [], [], 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith("-"):
            takes_next = arg in VALUE_OPTIONS and i + 1 < len(rest)
            options += rest[i : i + 2] if takes_next else [arg]
            i += 2 if takes_next else 1
        else:
            paths.append(arg)
            i += 1
    return paths, options


def function_of(nodeid: str) -> str:
    """`path::test_name` of a node id: the parametrizations of one test function share it."""
    return nodeid.split("[", 1)[0]


def plan_jobs(needs: dict[str, int], gpus: int, durations: dict[str, float], lanes_per_gpu: int = 1) -> list[Job]:
    """The jobs, in the order they start: each test that needs several GPUs (and the machine has them) alone, most
    GPUs first, then longest first; then the one-GPU tests as `gpus` x `lanes_per_gpu` lanes balanced on their
    expected durations (longest function first, to the lane with least work; a test function's parametrizations stay
    together). Tests that need more GPUs than there are join the first lane, where pytest skips them and says why."""
    lanes = max(gpus, 1)

    def expected(test: str) -> float:
        return durations.get(function_of(test), UNKNOWN_TEST_SECONDS)

    several = sorted((t for t, n in needs.items() if 1 < n <= lanes), key=lambda t: (-needs[t], -expected(t), t))
    jobs = [Job(f"gpus{needs[t]}_{i}", [t], needs[t], expected(t)) for i, t in enumerate(several)]

    functions: dict[str, list[str]] = {}
    for t, n in needs.items():
        if n <= 1:
            functions.setdefault(function_of(t), []).append(t)
    work = [Job(f"lane{i}", [], 1, 0.0) for i in range(lanes * lanes_per_gpu)]
    for fn in sorted(functions, key=lambda f: (-durations.get(f, UNKNOWN_TEST_SECONDS), f)):
        lane = min(work, key=lambda j: j.expected_s)
        lane.tests += functions[fn]
        lane.expected_s += durations.get(fn, UNKNOWN_TEST_SECONDS)
    work[0].tests += [t for t, n in needs.items() if n > lanes]
    return jobs + sorted((j for j in work if j.tests), key=lambda j: -j.expected_s)


class GpuSlots:
    """Which GPUs a job may take: `per_gpu` one-GPU processes share a GPU; a job of several GPUs takes each of its
    GPUs whole (no other process on them)."""

    def __init__(self, gpus: list[str], per_gpu: int = 1):
        self.per_gpu = per_gpu if gpus else 1
        self.free = dict.fromkeys(gpus or [""], self.per_gpu)  # no GPU: one lane, whose tests skip themselves

    def take(self, n: int) -> list[str] | None:
        """GPUs for a job of `n`, in the machine's order, or None while they are busy."""
        if n == 1:
            gpu = max(self.free, key=lambda g: self.free[g])  # the emptiest GPU, the first of equals
            if self.free[gpu] == 0:
                return None
            self.free[gpu] -= 1
            return [gpu]
        whole = [g for g, left in self.free.items() if left == self.per_gpu][:n]
        if len(whole) < n:
            return None
        for g in whole:
            self.free[g] = 0
        return whole

    def give_back(self, gpus: list[str]) -> None:
        for g in gpus:
            self.free[g] += 1 if len(gpus) == 1 else self.per_gpu


# Two lanes on one GPU: each engine's KV cache a fixed size (shared_gpu_kv_cache.py), so that vLLM does not size it by
# watching the GPU's free memory while the other lane's engines start and stop. Ample for the suite's small models, and
# well inside the 0.25 of an H200 (35 GiB) that vLLM still checks is free when an engine starts.
SHARED_GPU_KV_CACHE_BYTES = 8 << 30


def shared_gpu_plugin(folder: Path) -> Path:
    """`folder`, made an import path that holds `shared_gpu_kv_cache` and its `vllm.general_plugins` entry point
    (vLLM finds plugins only through installed metadata, in each of its processes, servers' too)."""
    info = folder / "trl_fp8_gpu_suite_shared_gpu-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).with_name("shared_gpu_kv_cache.py"), folder)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trl-fp8-gpu-suite-shared-gpu\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nshared_gpu_kv_cache = "
                                           "shared_gpu_kv_cache:fix_kv_cache_size\n")  # fmt: skip
    return folder


def run_jobs(
    jobs: list[Job],
    gpus: list[str],
    logs: Path,
    extra: list[str],
    poll_s: float = POLL_S,
    on_done=None,
    lanes_per_gpu: int = 1,
) -> list[int]:
    """Starts each job, in order, once its GPUs are free (none overtakes the one before it, so a four-GPU job is
    not starved by one-GPU lanes), `lanes_per_gpu` one-GPU processes to a GPU; calls `on_done()` as each ends;
    returns the exit codes."""
    slots = GpuSlots(list(gpus), lanes_per_gpu)
    processes = max(len(gpus), 1) * slots.per_gpu  # the most that run at once
    plugin = shared_gpu_plugin(logs / "shared_gpu_plugin") if slots.per_gpu > 1 else None  # written once a run
    running: dict[int, tuple[subprocess.Popen, object, float]] = {}
    codes: dict[int, int] = {}
    queue = list(range(len(jobs)))
    while queue or running:
        while queue and (assigned := slots.take(jobs[queue[0]].gpus)) is not None:
            job = jobs[queue[0]]
            job.assigned = assigned
            env = {**os.environ, "TRL_FP8_TEST_GPUS": ",".join(job.assigned)}
            if "TRL_FP8_ARTIFACTS" not in env:  # each process's own: two servers' logs never overwrite each other
                (artifacts := logs / f"{job.name}_artifacts").mkdir(exist_ok=True)
                env["TRL_FP8_ARTIFACTS"] = str(artifacts)
            env.pop("MASTER_PORT", None)  # each GPU test picks one of its own (tests/conftest.py)
            # The machine's cores shared between the processes running at once: left alone, each takes them all for
            # its CPU work (a demo's warm start, compiles), and the GPUs' processes contend for them.
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
            paths = [str(ROOT / "tests")]
            if slots.per_gpu > 1 and job.gpus == 1:  # it shares its GPU: a fixed KV cache, no start-up measurement
                paths.append(str(plugin))
                env[KV_CACHE_BYTES_ENV] = str(SHARED_GPU_KV_CACHE_BYTES)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
            (logs / f"{job.name}.xml").unlink(missing_ok=True)  # a previous run's would speak for this process
            log = open(logs / f"{job.name}.log", "w")  # noqa: SIM115 (closed when the process ends)
            basetemp = Path(tempfile.gettempdir()) / f"trl_fp8_gpu_suite_{job.name}"  # none shared: pytest wipes it
            cmd = [*PYTEST, f"--junitxml={logs / job.name}.xml", f"--basetemp={basetemp}", *extra, *job.tests]
            running[queue.pop(0)] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                                     log, time.time())  # fmt: skip
            print(f"[start] {job.name} on GPU {','.join(job.assigned) or '-'}: {len(job.tests)} tests, "
                  f"~{job.expected_s:.0f} s planned", flush=True)  # fmt: skip
        time.sleep(poll_s)
        for i, (proc, log, started) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[i]
            codes[i] = proc.returncode
            slots.give_back(jobs[i].assigned)
            counts = junit_counts(logs / f"{jobs[i].name}.xml")
            print(f"[done]  {jobs[i].name}: {summary_line(counts)} in {time.time() - started:.0f} s "
                  f"(exit {proc.returncode})", flush=True)  # fmt: skip
            if on_done is not None:
                on_done()
    return [codes[i] for i in range(len(jobs))]


COUNTS = ("failed", "errors", "passed", "skipped", "xfailed")  # a summary's order, pytest's


def junit_root(path: Path) -> ET.Element:
    """pytest's JUnit file `path`, parsed; an empty one if the process wrote none (it crashed, or never started)."""
    return ET.parse(path).getroot() if path.exists() else ET.Element("testsuites")


def junit_counts(path: Path) -> dict[str, int]:
    """passed/failed/errors/skipped/xfailed from pytest's JUnit file (all zero if the process wrote none). JUnit counts
    an expected failure (`xfail`) as skipped; it is counted apart here, as pytest's own summary does."""
    counts = dict.fromkeys(COUNTS, 0)
    for suite in junit_root(path).iter("testsuite"):
        tests, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        xfailed = sum(is_xfail(skip) for skip in suite.iter("skipped"))
        counts["failed"] += failed
        counts["errors"] += errors
        counts["skipped"] += skipped - xfailed
        counts["xfailed"] += xfailed
        counts["passed"] += tests - failed - errors - skipped
    return counts


def is_xfail(skipped: ET.Element) -> bool:
    """Whether a JUnit `skipped` element is pytest's expected failure rather than a skip."""
    return skipped.get("type") == "pytest.xfail"


def junit_name(nodeid: str) -> tuple[str, str]:
    """`(classname, name)` of the test `nodeid` in pytest's JUnit file, as pytest's `mangle_test_address` makes them:
    the file's path dotted, without `.py`, then any classes; the test's name with its parameters (which may hold
    `::`, `/` or `.`)."""
    path, bracket, params = nodeid.partition("[")
    scope = path.split("::")
    scope[0] = scope[0].replace("/", ".").removesuffix(".py")
    return ".".join(scope[:-1]), scope[-1] + bracket + params


def junit_cases(path: Path, tests: list[str]) -> dict[str, ET.Element]:
    """Node id -> its testcase in pytest's JUnit file `path`, for each of `tests` the file holds; one it lacks never
    ran (its process stopped at `-x`/`--maxfail`, or crashed, first)."""
    by_name = {junit_name(t): t for t in tests}
    found = ((by_name.get((case.get("classname", ""), case.get("name", ""))), case)
             for case in junit_root(path).iter("testcase"))  # fmt: skip
    return {test: case for test, case in found if test is not None}


def junit_durations(path: Path, tests: list[str]) -> dict[str, float]:
    """Seconds per test function (`path::name`, its parametrizations summed), for the next run's lanes. A skipped
    case says nothing of its test's time (a two-GPU test skips itself on one GPU in no time), so it is left out."""
    out: dict[str, float] = {}
    for test, case in junit_cases(path, tests).items():
        if case.find("skipped") is None:
            out[function_of(test)] = out.get(function_of(test), 0.0) + float(case.get("time", 0.0))
    return out


def skip_reasons(paths: list[Path]) -> Counter[str]:
    """How many tests skipped for each reason, over pytest's JUnit files `paths`."""
    return Counter(skip.get("message", "") for path in paths for skip in junit_root(path).iter("skipped")
                   if not is_xfail(skip))  # fmt: skip


# vLLM sizes its engine by watching the GPU's free memory while the engine starts: it stops when that grows (another
# process freed some), and finds no room for its KV cache when another process took memory meanwhile (it counts that
# as its own): two lanes on one GPU do that to each other, whatever the test checks.
SHARED_GPU_FAILURES = ("Error in memory profiling", "No available memory for the cache blocks")


def shared_gpu_failures(path: Path, tests: list[str]) -> dict[str, list[str]]:
    """The tests of pytest's JUnit file `path` that failed on vLLM's start-up memory check (`SHARED_GPU_FAILURES`):
    node id -> the count each report of it took (`failed`, `errors`; a test failing and then erroring in teardown has
    both)."""
    out: dict[str, list[str]] = {}
    for test, case in junit_cases(path, tests).items():
        reports = [(tag, el) for tag in ("failure", "error") for el in case.findall(tag)]
        texts = [el.get("message", "") + (el.text or "") for _, el in reports]
        if any(message in text for text in texts for message in SHARED_GPU_FAILURES):
            out[test] = ["failed" if tag == "failure" else "errors" for tag, _ in reports]
    return out


def write_durations(jobs: list[Job], logs: Path) -> None:
    """`logs/durations.json`: seconds per test function, from the JUnit files of the processes that have ended."""
    measured: dict[str, float] = {}
    for job in jobs:
        measured |= junit_durations(logs / f"{job.name}.xml", job.tests)
    (logs / "durations.json").write_text(json.dumps(dict(sorted(measured.items())), indent=1) + "\n")


def summary_line(counts: dict[str, int]) -> str:
    parts = [f"{counts[k]} {k}" for k in COUNTS if counts[k]]
    return ", ".join(parts) or "no tests ran"


def collect(paths: list[str], options: list[str], out: Path) -> dict[str, int]:
    """Node id -> GPUs needed, for the GPU tests under `paths` that the pytest `options` select (`-k`, `--deselect`,
    as the processes will run them), collected in a process of its own (collection imports the test modules, and
    with them CUDA). Empty when they select none."""
    cmd = [sys.executable, __file__, "--collect-into", str(out), *options, *paths]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 5:  # pytest's "no tests collected"
        return {}
    if proc.returncode != 0 or not out.exists():
        print(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"collecting the GPU tests failed (exit {proc.returncode}); its output is above")
    return json.loads(out.read_text())


def _collect_here(out: str, args: list[str]) -> int:
    import pytest

    sys.path.insert(0, str(ROOT))  # as `python -m pytest` from the root has it

    class Needs:
        def pytest_collection_finish(self, session):
            needs = {}
            for item in session.items:
                marker = item.get_closest_marker("gpus")
                needs[item.nodeid] = int(marker.args[0]) if marker else 1
            Path(out).write_text(json.dumps(needs, indent=1))

    return pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *args], plugins=[Needs()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--collect-into"]:
        return _collect_here(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", help="GPUs to use, as CUDA_VISIBLE_DEVICES names them (default: all visible)")
    parser.add_argument("--logs", default="gpu_suite_logs", help="folder for each process's log and JUnit file")
    parser.add_argument("--durations", default=str(DURATIONS), help="seconds per test function, to balance lanes")
    parser.add_argument("--lanes-per-gpu", type=int, default=1, metavar="N",
                        help="one-GPU test processes sharing each GPU (default 1; the tests' engines take 0.25 of "
                             "a GPU each, so an H200 holds two)")  # fmt: skip
    parser.add_argument("--allow-all-skipped", action="store_true",
                        help="pass when every test skipped (a machine without an SM90 GPU or vLLM tests nothing); "
                             "by default that fails, with the skip reasons")  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    paths, extra = split_arguments(rest)
    paths = paths or [str(Path(__file__).parent.relative_to(ROOT))]
    gpus = args.gpus.split(",") if args.gpus else visible_gpus()
    logs = Path(args.logs).resolve()
    logs.mkdir(parents=True, exist_ok=True)

    start = time.time()
    needs = collect(paths, extra, logs / "collected.json")
    if not needs:
        print(f"no GPU test selected by paths {' '.join(paths)} and options {' '.join(extra) or '(none)'}: a -k, -m "
              "or --deselect that matches no test (a typo?), or paths that hold no GPU test")  # fmt: skip
        return 1
    durations = json.loads(Path(args.durations).read_text()) if Path(args.durations).exists() else {}
    if args.lanes_per_gpu < 1:
        parser.error("--lanes-per-gpu must be 1 or more")
    jobs = plan_jobs(needs, len(gpus), durations, args.lanes_per_gpu)
    print(f"{len(needs)} GPU tests in {len(jobs)} pytest processes on {len(gpus)} GPU(s) ({','.join(gpus) or 'none'})")
    run = run_planned(jobs, gpus, logs, extra, durations, args.lanes_per_gpu, poll_s=POLL_S)
    for job, code in run.failed:
        print(f"--- {job.name} (exit {code}), the end of {logs / job.name}.log:")
        print("".join((logs / f"{job.name}.log").read_text().splitlines(keepends=True)[-40:]))
    problems = suite_problems(run, args.allow_all_skipped)
    for problem in problems:
        print(f"suite failed: {problem}")
    wall = time.time() - start
    notes = [f"{len(run.again)} run again alone (vLLM's memory check on a shared GPU)"] if run.again else []
    notes += [f"{len(run.not_reached)} not reached by their lane, run alone"] if run.not_reached else []
    notes += [f"{len(run.not_run)} never ran"] if run.not_run else []
    print(f"===== {summary_line(run.total)} in {wall:.2f}s ({time.strftime('%H:%M:%S', time.gmtime(wall))}) on "
          f"{len(gpus)} GPU(s), {len(jobs)} processes{''.join(f'; {note}' for note in notes)} =====")  # fmt: skip
    return 1 if run.failed or run.total["failed"] or run.total["errors"] or problems else 0


@dataclass
class SuiteRun:
    """What `run_planned` ran and what it found."""

    total: dict[str, int]  # passed/failed/errors/skipped/xfailed; a test run alone counts once, by that run
    failed: list[tuple[Job, int]]  # the processes that failed and were not forgiven, with their exit codes
    again: list[str]  # tests that failed on vLLM's start-up memory check and ran again alone
    not_reached: list[str]  # tests a lane stopped on that check never reached, run alone with them
    not_run: list[str]  # planned tests no JUnit file has a result for
    skip_reasons: Counter[str]  # of every process's skipped tests


def suite_problems(run: SuiteRun, allow_all_skipped: bool = False) -> list[str]:
    """Why a suite whose processes may all have passed still fails: a planned test never ran, or every test skipped
    (nothing was tested) and that was not allowed."""
    problems = []
    if run.not_run:
        shown = " ".join(run.not_run[:20]) + (f" and {len(run.not_run) - 20} more" if len(run.not_run) > 20 else "")
        problems.append(f"{len(run.not_run)} planned test(s) never ran (their process stopped first: -x or --maxfail "
                        f"after a failure, or it crashed; its log says which): {shown}")  # fmt: skip
    total = run.total
    if total["skipped"] and not (total["passed"] or total["failed"] or total["errors"]) and not allow_all_skipped:
        reasons = "; ".join(f"{n} x {reason}" for reason, n in run.skip_reasons.most_common())
        problems.append(f"every test skipped, so nothing was tested ({reasons}); run it where they can run, or pass "
                        "--allow-all-skipped to accept that")  # fmt: skip
    return problems


def run_planned(
    jobs: list[Job],
    gpus: list[str],
    logs: Path,
    extra: list[str],
    durations: dict[str, float],
    lanes_per_gpu: int,
    poll_s: float = POLL_S,
) -> SuiteRun:
    """Runs `jobs`, then, with lanes sharing GPUs, the tests that failed on vLLM's start-up memory check again, one
    process per GPU (`alone<i>`), with the tests that a lane stopped by that check (`-x`, `--maxfail`) never reached.
    A test run alone counts once, by that run. A process is forgiven its failures only if it exited 1 (tests failed),
    each failure was that check, and each of its tests is in its JUnit file or was run alone."""
    ran = list(jobs)
    codes = run_jobs(jobs, gpus, logs, extra, poll_s=poll_s, on_done=lambda: write_durations(ran, logs),
                     lanes_per_gpu=lanes_per_gpu)  # fmt: skip
    counts = {job.name: junit_counts(logs / f"{job.name}.xml") for job in jobs}
    cases = {job.name: junit_cases(logs / f"{job.name}.xml", job.tests) for job in jobs}
    failed_on_check: dict[str, dict[str, list[str]]] = {}  # process -> shared_gpu_failures of its JUnit file
    again: list[str] = []
    not_reached: list[str] = []
    if lanes_per_gpu > 1:
        for job, code in zip(jobs, codes, strict=True):
            failed_on_check[job.name] = shared_gpu_failures(logs / f"{job.name}.xml", job.tests)
            for test, reports in failed_on_check[job.name].items():
                again.append(test)
                for key in reports:
                    counts[job.name][key] -= 1
            left = counts[job.name]
            if failed_on_check[job.name] and code == 1 and not (left["failed"] or left["errors"]):
                # pytest stopped (-x, --maxfail) on failures that the run alone judges: it judges the rest too
                not_reached += [test for test in job.tests if test not in cases[job.name]]
    alone: list[Job] = []
    if again:
        stopped = f", and {len(not_reached)} that their stopped lanes never reached" if not_reached else ""
        print(f"{len(again)} test(s) failed on vLLM's start-up memory check, which another process on the same GPU "
              f"upsets{stopped}; running them alone, one process per GPU: {' '.join(again + not_reached)}",
              flush=True)  # fmt: skip
        alone = plan_jobs(dict.fromkeys(again + not_reached, 1), len(gpus), durations)
        for i, job in enumerate(alone):
            job.name = f"alone{i}"
        ran += alone
        codes += run_jobs(alone, gpus, logs, extra, poll_s=poll_s, on_done=lambda: write_durations(ran, logs))
        counts |= {job.name: junit_counts(logs / f"{job.name}.xml") for job in alone}
        cases |= {job.name: junit_cases(logs / f"{job.name}.xml", job.tests) for job in alone}
    total = dict.fromkeys(COUNTS, 0)
    for job_counts in counts.values():
        for k, v in job_counts.items():
            total[k] += v
    # a test's result is its last run's: one run alone has none if that process stopped or crashed before it
    run_alone = set(again + not_reached)
    results = {test for job in ran for test in cases[job.name] if job in alone or test not in run_alone}

    def forgiven(job: Job, code: int) -> bool:  # what the tests it handed on do is the run alone's to answer for
        left = counts[job.name]
        return (code == 1 and bool(failed_on_check.get(job.name)) and not (left["failed"] or left["errors"])
                and all(test in cases[job.name] or test in run_alone for test in job.tests))  # fmt: skip

    # a process failed unless it exited 0 or was forgiven: an interrupted one or an internal error (2-4), one that
    # selected none of its tests (5) or crashed stays a failure
    failed = [(job, code) for job, code in zip(ran, codes, strict=True) if code != 0 and not forgiven(job, code)]
    not_run = [test for job in jobs for test in job.tests if test not in results]
    reasons = skip_reasons([logs / f"{job.name}.xml" for job in ran])
    return SuiteRun(total, failed, again, not_reached, not_run, reasons)


if __name__ == "__main__":
    sys.exit(main())
