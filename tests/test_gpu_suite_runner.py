"""tests/gpu/run_suite.py, the GPU suite's one command: how it splits the tests over a machine's GPUs, that no GPU
runs two of its processes at once unless asked (`--lanes-per-gpu`), and how it reads pytest's JUnit files."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("run_suite", Path(__file__).parent / "gpu" / "run_suite.py")
run_suite = sys.modules["run_suite"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_suite)  # it puts tests/gpu on the path, for shared_gpu_kv_cache

NEEDS = {
    "tests/gpu/test_a.py::test_server_tp2": 4,
    "tests/gpu/test_b.py::test_two[ddp]": 2,
    "tests/gpu/test_b.py::test_two[fsdp2]": 2,
    "tests/gpu/test_c.py::test_kernel[1]": 1,
    "tests/gpu/test_c.py::test_kernel[2]": 1,
    "tests/gpu/test_c.py::test_small": 1,
    "tests/gpu/test_d.py::test_engine": 1,
    "tests/gpu/test_d.py::test_sleep": 1,
    "tests/gpu/test_d.py::test_moe": 1,
}
DURATIONS = {
    "tests/gpu/test_a.py::test_server_tp2": 150,
    "tests/gpu/test_b.py::test_two": 200,  # both parametrizations
    "tests/gpu/test_c.py::test_kernel": 40,
    "tests/gpu/test_c.py::test_small": 5,
    "tests/gpu/test_d.py::test_engine": 90,
    "tests/gpu/test_d.py::test_sleep": 80,
}  # test_moe has no record: planned at UNKNOWN_TEST_SECONDS


def test_four_gpus_run_the_widest_tests_first_then_balanced_one_gpu_lanes():
    jobs = run_suite.plan_jobs(NEEDS, 4, DURATIONS)
    assert [(j.gpus, j.tests) for j in jobs[:3]] == [
        (4, ["tests/gpu/test_a.py::test_server_tp2"]),
        (2, ["tests/gpu/test_b.py::test_two[ddp]"]),
        (2, ["tests/gpu/test_b.py::test_two[fsdp2]"]),
    ]
    lanes = jobs[3:]
    assert all(j.gpus == 1 for j in lanes) and len(lanes) == 4
    one_gpu = [t for t, n in NEEDS.items() if n == 1]
    assert sorted(t for j in lanes for t in j.tests) == sorted(one_gpu)  # each once
    # a function's parametrizations share a lane; the longest tests each get a lane of their own
    kernel_lanes = [j for j in lanes if any("test_kernel" in t for t in j.tests)]
    assert len(kernel_lanes) == 1 and {
        "tests/gpu/test_c.py::test_kernel[1]",
        "tests/gpu/test_c.py::test_kernel[2]",
    } <= set(kernel_lanes[0].tests)
    assert [j.expected_s for j in lanes] == sorted((j.expected_s for j in lanes), reverse=True)
    assert lanes[0].expected_s == 90 and lanes[-1].expected_s == 40 + 5


def test_one_gpu_is_one_process_that_reports_the_wider_tests_skipped():
    (job,) = run_suite.plan_jobs(NEEDS, 1, DURATIONS)
    assert job.gpus == 1 and sorted(job.tests) == sorted(NEEDS)
    two = run_suite.plan_jobs(NEEDS, 2, DURATIONS)
    assert [j.gpus for j in two] == [2, 2, 1, 1]
    assert any("tests/gpu/test_a.py::test_server_tp2" in j.tests for j in two[2:])  # skipped there, with the reason


def _run_stand_ins(tmp_path, monkeypatch, widths: dict, seconds: dict, gpus: list[str], **run_jobs_kwargs):
    """`run_suite.run_jobs` over stand-in processes, one job per name of `widths` (its GPU count) sleeping
    `seconds[name]`: the exit codes, and each process's record `[name, its GPUs, start, end, OMP_NUM_THREADS, its
    artifacts folder]`."""
    record = tmp_path / "record.jsonl"
    stand_in = (
        "import json, os, sys, time; start = time.time(); name, secs = sys.argv[-1].split('=')\n"
        "time.sleep(float(secs))\n"
        f"open({str(record)!r}, 'a').write(json.dumps([name, os.environ['TRL_FP8_TEST_GPUS'], start, time.time(), "
        "os.environ['OMP_NUM_THREADS'], os.environ['TRL_FP8_ARTIFACTS']]) + '\\n')"
    )
    monkeypatch.setattr(run_suite, "PYTEST", [sys.executable, "-c", stand_in])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TRL_FP8_ARTIFACTS", raising=False)
    jobs = [run_suite.Job(name, [f"{name}={seconds[name]}"], n, 0.0) for name, n in widths.items()]
    codes = run_suite.run_jobs(jobs, gpus, tmp_path, [], poll_s=0.05, **run_jobs_kwargs)
    return codes, [json.loads(line) for line in record.open()]


def test_no_gpu_runs_two_processes_at_once_and_none_is_overtaken(tmp_path, monkeypatch, capsys):
    """The scheduler with stand-in processes that log when they ran on which GPUs."""
    widths = {"w4": 4, "a2": 2, "b2": 2, "c2": 2, "l0": 1, "l1": 1, "l2": 1, "l3": 1, "l4": 1}
    seconds = {"w4": 0.4, "a2": 1.2, "b2": 0.3, "c2": 0.3, "l0": 0.1, "l1": 0.2, "l2": 0.3, "l3": 0.4, "l4": 0.5}
    ended = []  # the runner rewrites durations.json as each process ends (a run cut short keeps what finished)
    codes, lines = _run_stand_ins(tmp_path, monkeypatch, widths, seconds, ["0", "1", "2", "3"],
                                  on_done=lambda: ended.append(1))  # fmt: skip
    assert codes == [0] * len(widths) and len(ended) == len(widths)
    runs = {name: (gpus.split(","), start, end) for name, gpus, start, end, *_ in lines}
    # the cores shared among the (at most four) processes running at once
    assert {threads for *_, threads, _ in lines} == {str(max(1, (os.cpu_count() or 1) // 4))}
    # each process keeps what its tests save in a folder of its own beside its log
    assert {name: folder for name, *_, folder in lines} == {
        name: str(tmp_path / f"{name}_artifacts") for name in widths
    }
    assert all((tmp_path / f"{name}_artifacts").is_dir() for name in widths)
    assert sorted(runs) == sorted(widths)
    assert all(len(runs[name][0]) == n for name, n in widths.items())
    started = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("[start]")]
    assert started == list(widths)  # launched in order
    for x, (gx, sx, ex) in runs.items():
        for y, (gy, sy, ey) in runs.items():
            if x != y and set(gx) & set(gy):
                assert ex <= sy or ey <= sx, (x, y)  # a GPU's processes never overlap
    assert runs["a2"][0] == ["0", "1"] and runs["b2"][0] == runs["c2"][0] == ["2", "3"]  # c2 took b2's GPUs
    assert runs["c2"][1] < runs["a2"][2]  # ... while a2 was still running


def test_lanes_per_gpu_split_the_one_gpu_tests_further():
    """`--lanes-per-gpu 2`: twice the one-GPU lanes, balanced the same way; the wider tests keep their jobs."""
    one = run_suite.plan_jobs(NEEDS, 1, DURATIONS, lanes_per_gpu=2)
    assert [j.gpus for j in one] == [1, 1] and sorted(t for j in one for t in j.tests) == sorted(NEEDS)
    assert {j.expected_s for j in one} == {90 + 40 + 5, 80 + run_suite.UNKNOWN_TEST_SECONDS}
    four = run_suite.plan_jobs(NEEDS, 4, DURATIONS, lanes_per_gpu=2)
    assert [j.gpus for j in four[:3]] == [4, 2, 2] and len(four) == 3 + 5  # five one-GPU functions, eight lanes


def test_lanes_per_gpu_share_a_gpu_but_never_with_a_wider_job(tmp_path, monkeypatch):
    """Two lanes to a GPU run at once, never three; a two-GPU job has its GPUs to itself."""
    widths = {"w2": 2, "l0": 1, "l1": 1, "l2": 1, "l3": 1, "l4": 1, "l5": 1}
    seconds = {"w2": 0.4, "l0": 0.6, "l1": 0.6, "l2": 0.6, "l3": 0.6, "l4": 0.3, "l5": 0.3}
    codes, lines = _run_stand_ins(tmp_path, monkeypatch, widths, seconds, ["0", "1"], lanes_per_gpu=2)
    assert codes == [0] * len(widths)
    runs = {name: (gpus.split(","), start, end) for name, gpus, start, end, *_ in lines}
    assert {threads for *_, threads, _ in lines} == {str(max(1, (os.cpu_count() or 1) // 4))}
    assert runs["w2"][0] == ["0", "1"] and all(len(runs[f"l{i}"][0]) == 1 for i in range(6))
    for lane in (f"l{i}" for i in range(6)):  # the wide job alone on its GPUs
        assert runs[lane][1] >= runs["w2"][2] or runs[lane][2] <= runs["w2"][1]
    for gpu in ("0", "1"):
        spans = [(s, e) for g, s, e in runs.values() if g == [gpu]]
        at_once = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
        assert at_once == 2, gpu  # two lanes shared the GPU, never three


PLUGIN_STAND_IN = """
import importlib.metadata, json, os, sys
name = sys.argv[-1]
plugins = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
found = plugins["shared_gpu_kv_cache"].load().__name__ if "shared_gpu_kv_cache" in plugins else None
open(RECORD, "a").write(json.dumps([name, os.environ.get("TRL_FP8_TEST_KV_CACHE_BYTES"), found]) + "\\n")
"""


@pytest.mark.parametrize("lanes_per_gpu", [1, 2])
def test_processes_sharing_a_gpu_find_the_fixed_kv_cache_plugin_and_the_others_do_not(
    tmp_path, monkeypatch, lanes_per_gpu
):
    """vLLM finds its plugins through installed metadata, in every process it starts: a process that shares its GPU
    (a one-GPU lane with `--lanes-per-gpu 2`) finds `shared_gpu_kv_cache` as a `vllm.general_plugins` entry point in a
    fresh interpreter, with the size it sets; a process with its GPUs to itself (one lane per GPU, or a two-GPU job)
    finds neither, and keeps vLLM's own sizing."""
    record = tmp_path / "record.jsonl"
    monkeypatch.setattr(
        run_suite, "PYTEST", [sys.executable, "-c", PLUGIN_STAND_IN.replace("RECORD", repr(str(record)))]
    )
    monkeypatch.delenv(run_suite.KV_CACHE_BYTES_ENV, raising=False)
    jobs = [
        run_suite.Job("w2", ["w2"], 2, 0.0),
        run_suite.Job("l0", ["l0"], 1, 0.0),
        run_suite.Job("l1", ["l1"], 1, 0.0),
    ]
    codes = run_suite.run_jobs(jobs, ["0", "1"], tmp_path, [], poll_s=0.05, lanes_per_gpu=lanes_per_gpu)
    assert codes == [0, 0, 0]
    seen = {name: (size, found) for name, size, found in map(json.loads, record.open())}
    shared = (str(run_suite.SHARED_GPU_KV_CACHE_BYTES), "fix_kv_cache_size")
    assert seen == {"w2": (None, None), **dict.fromkeys(["l0", "l1"], shared if lanes_per_gpu > 1 else (None, None))}


def test_the_fixed_kv_cache_plugin_sizes_only_engines_that_set_no_size_and_wraps_once(monkeypatch):
    """`shared_gpu_kv_cache` on a stand-in for vLLM's `EngineArgs`: an engine with no `kv_cache_memory_bytes` gets
    the runner's size in the configuration it builds, one with its own keeps it, and a second patch adds no second
    layer. Without the runner's variable it does nothing (and imports no vLLM)."""
    import shared_gpu_kv_cache as plugin

    class EngineArgs:
        def __init__(self, kv_cache_memory_bytes=None):
            self.kv_cache_memory_bytes = kv_cache_memory_bytes

        def create_engine_config(self, usage_context=None):
            return {"kv_cache_memory_bytes": self.kv_cache_memory_bytes, "usage_context": usage_context}

    plugin.patch_engine_args(EngineArgs, 8 << 30)
    patched = EngineArgs.create_engine_config
    plugin.patch_engine_args(EngineArgs, 4 << 30)
    assert EngineArgs.create_engine_config is patched
    assert EngineArgs().create_engine_config("llm") == {"kv_cache_memory_bytes": 8 << 30, "usage_context": "llm"}
    assert EngineArgs(1 << 30).create_engine_config()["kv_cache_memory_bytes"] == 1 << 30
    monkeypatch.delenv(plugin.KV_CACHE_BYTES_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vLLM would raise
    plugin.fix_kv_cache_size()


JUNIT_STAND_IN = """
import os, sys
from _pytest.junitxml import mangle_test_address  # the classname and name pytest's JUnit file gives a node id
outcomes = {outcomes!r}  # test function -> pass, vllm / vllm_kv (failed on vLLM's start-up memory check: memory freed,
# memory taken by the other lane), fail, skip:<reason>
xml = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
if os.path.basename(xml).startswith("alone"):  # run again alone: nothing shares the GPU now
    outcomes = {{name: outcome for name, outcome in outcomes.items() if not outcome.startswith("vllm")}}
args = sys.argv[1:]
keyword = args[args.index("-k") + 1] if "-k" in args else ""  # as pytest's -k, for a plain word
maxfail = 1 if "-x" in args else int(args[args.index("--maxfail") + 1]) if "--maxfail" in args else 0
reports = {{
    "vllm": '<failure message="AssertionError: Error in memory profiling. Initial free memory 128.7 GiB, current '
    'free memory 138.3 GiB.">trace</failure>',
    "vllm_kv": '<failure message="AssertionError: in main">[rank0]: ValueError: No available memory for the cache '
    'blocks. Try increasing `gpu_memory_utilization`</failure>',
    "fail": '<failure message="assert 1 == 2">trace</failure>',
}}
cases, failures, skipped = [], 0, 0
for test in (a for a in args if "::" in a and keyword in a):
    if maxfail and failures >= maxfail:
        break  # -x, --maxfail: the tests after are never reached
    outcome = outcomes.get(test.split("[")[0].split("::")[-1], "pass")
    if outcome.startswith("skip:"):
        skipped += 1
        reports[outcome] = f'<skipped type="pytest.skip" message="{{outcome[5:]}}">{{test}}: {{outcome[5:]}}</skipped>'
    else:
        failures += outcome != "pass"
    *classes, name = mangle_test_address(test)
    cases.append(f'<testcase classname="{{".".join(classes)}}" name="{{name}}" time="1">{{reports.get(outcome, "")}}'
                 "</testcase>")
open(xml, "w").write(f'<testsuites><testsuite tests="{{len(cases)}}" failures="{{failures}}" errors="0" '
                     f'skipped="{{skipped}}">' + "".join(cases) + "</testsuite></testsuites>")
sys.exit({exit_code} if failures else 0 if cases else 5)
"""


def _use_junit_stand_in(tmp_path, monkeypatch, outcomes: dict[str, str], exit_code: int = 1) -> None:
    """The runner's pytest processes replaced by `JUNIT_STAND_IN`: each writes a JUnit file of its tests' `outcomes`
    (by test function; a test not named passes) and exits `exit_code` when one failed, as pytest does on 1."""
    (stand_in := tmp_path / "stand_in.py").write_text(JUNIT_STAND_IN.format(outcomes=outcomes, exit_code=exit_code))
    monkeypatch.setattr(run_suite, "PYTEST", [sys.executable, str(stand_in)])


def _main(tmp_path, monkeypatch, capsys, argv: list[str], needs: dict[str, int] | None = None) -> tuple[int, str]:
    """`run_suite.main(argv)` on one GPU ("0") over the stand-in processes, logging to `tmp_path/logs`, with
    `needs` as what collection found (None: collected for real): its exit code and what it printed."""
    if needs is not None:
        monkeypatch.setattr(run_suite, "collect", lambda *args: dict(needs))
    monkeypatch.setattr(run_suite, "POLL_S", 0.05)
    code = run_suite.main(["--logs", str(tmp_path / "logs"), "--gpus", "0", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("memory_check", ["vllm", "vllm_kv"])
@pytest.mark.parametrize("real_failure", [False, True])
def test_lanes_run_again_alone_only_what_failed_on_vllms_memory_check(
    tmp_path, monkeypatch, real_failure, memory_check
):
    """Two lanes on one GPU: a test that failed on vLLM's start-up memory check (the other lane freed memory, or took
    what this engine's KV cache was to have) runs again alone and counts once, by that run; any other failure stays a
    failure."""
    sleep = "fail" if real_failure else "pass"
    _use_junit_stand_in(tmp_path, monkeypatch, {"test_engine": memory_check, "test_sleep": sleep})
    tests = ["tests/gpu/test_d.py::test_engine", "tests/gpu/test_d.py::test_sleep", "tests/gpu/test_c.py::test_small"]
    jobs = run_suite.plan_jobs(dict.fromkeys(tests, 1), 1, DURATIONS, lanes_per_gpu=2)
    run = run_suite.run_planned(jobs, ["0"], tmp_path, [], DURATIONS, 2, poll_s=0.05)
    assert run.again == ["tests/gpu/test_d.py::test_engine"] and run.not_reached == run.not_run == []
    assert (tmp_path / "alone0.xml").exists()
    if real_failure:
        assert run.total == {"passed": 2, "failed": 1, "errors": 0, "skipped": 0, "xfailed": 0}
        assert [job for job, _ in run.failed] == [j for j in jobs if "tests/gpu/test_d.py::test_sleep" in j.tests]
    else:
        assert run.total == {"passed": 3, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0} and run.failed == []
    # with one process per GPU nothing shared the GPU: the same failure is a failure, run once
    (one := tmp_path / "one").mkdir()
    run = run_suite.run_planned(run_suite.plan_jobs(dict.fromkeys(tests, 1), 1, DURATIONS), ["0"], one, [],
                                DURATIONS, 1, poll_s=0.05)  # fmt: skip
    assert run.again == [] and run.total["failed"] == 1 + real_failure and len(run.failed) == 1


def test_a_lane_that_did_not_end_as_pytest_ends_on_failed_tests_stays_failed(tmp_path, monkeypatch):
    """A lane whose only failure ran again alone, but which exited otherwise than pytest does on failed tests (3:
    an internal error), is still a failed process: only exit 1 is forgiven by the run alone."""
    _use_junit_stand_in(tmp_path, monkeypatch, {"test_engine": "vllm"}, exit_code=3)
    tests = ["tests/gpu/test_d.py::test_engine", "tests/gpu/test_c.py::test_small"]
    jobs = run_suite.plan_jobs(dict.fromkeys(tests, 1), 1, DURATIONS, lanes_per_gpu=2)
    run = run_suite.run_planned(jobs, ["0"], tmp_path, [], DURATIONS, 2, poll_s=0.05)
    assert run.again == ["tests/gpu/test_d.py::test_engine"] and run.total["failed"] == 0
    assert [(job.name, code) for job, code in run.failed] == [
        (job.name, 3) for job in jobs if "tests/gpu/test_d.py::test_engine" in job.tests
    ]


# Two lanes on one GPU, planned by these durations: lane0 test_other alone, lane1 test_engine, test_sleep, test_small
# in that order.
STOPPED_LANE = {
    "tests/gpu/test_e.py::test_other": 100,
    "tests/gpu/test_d.py::test_engine": 50,
    "tests/gpu/test_d.py::test_sleep": 5,
    "tests/gpu/test_c.py::test_small": 1,
}


@pytest.mark.parametrize("real_failure", [False, True])
def test_a_lane_stopped_on_vllms_memory_check_has_the_tests_it_never_reached_run_alone(
    tmp_path, monkeypatch, capsys, real_failure
):
    """`-x` with two lanes on a GPU: a lane stopped at its first test, which failed on vLLM's memory check, never ran
    the two behind it. Forgiving the lane once that test passed alone left the suite green, whatever those two would
    have done; they run alone with it, and the last line counts every test (with `-x`, the run alone stops at a real
    failure too: the test behind it never ran)."""
    sleep = "fail" if real_failure else "pass"
    _use_junit_stand_in(tmp_path, monkeypatch, {"test_engine": "vllm", "test_sleep": sleep})
    (durations := tmp_path / "durations.json").write_text(json.dumps(STOPPED_LANE))
    argv = ["--lanes-per-gpu", "2", "--durations", str(durations), "-x"]
    code, out = _main(tmp_path, monkeypatch, capsys, argv, needs=dict.fromkeys(STOPPED_LANE, 1))
    summary = out.splitlines()[-1]
    assert code == real_failure
    # the lane is forgiven (all it ran alone was handed on); the run alone answers for what it found
    assert [line.split()[1] for line in out.splitlines() if line.startswith("--- ")] == ["alone0"] * real_failure
    assert summary.startswith("===== 1 failed, 2 passed in " if real_failure else "===== 4 passed in ")
    assert summary.endswith("2 processes; 1 run again alone (vLLM's memory check on a shared GPU); "
                            f"2 not reached by their lane, run alone{'; 1 never ran' * real_failure} =====")  # fmt: skip


def test_tests_their_process_never_ran_fail_the_suite_by_name(tmp_path, monkeypatch, capsys):
    """One process per GPU, `--maxfail 1`: the tests after the failure never ran; the last line counts them and the
    suite names them (the failure alone would fail it, but the count of tests must add up)."""
    _use_junit_stand_in(tmp_path, monkeypatch, {"test_engine": "fail"})
    (durations := tmp_path / "durations.json").write_text(json.dumps(STOPPED_LANE))
    argv = ["--durations", str(durations), "--maxfail", "1"]
    code, out = _main(tmp_path, monkeypatch, capsys, argv, needs=dict.fromkeys(STOPPED_LANE, 1))
    assert code == 1
    assert "2 planned test(s) never ran (their process stopped first" in out
    assert "tests/gpu/test_d.py::test_sleep tests/gpu/test_c.py::test_small" in out.split("never ran", 1)[1]
    assert out.splitlines()[-1].startswith("===== 1 failed, 1 passed in ")
    assert out.splitlines()[-1].endswith("1 processes; 2 never ran =====")


def test_processes_that_ran_none_of_their_tests_fail_the_suite(tmp_path, monkeypatch, capsys):
    """Processes given tests that all exit 5 (pytest's "no tests collected": they selected none of them) once made
    a green suite of "no tests ran"; now each is a failed process and its tests are named as never run."""
    _use_junit_stand_in(tmp_path, monkeypatch, {})
    needs = dict.fromkeys(["tests/gpu/test_d.py::test_engine", "tests/gpu/test_c.py::test_small"], 1)
    code, out = _main(tmp_path, monkeypatch, capsys, ["-k", "no_such_test"], needs=needs)  # collected unfiltered
    assert code == 1 and "--- lane0 (exit 5)" in out and "2 planned test(s) never ran" in out
    assert out.splitlines()[-1].startswith("===== no tests ran in ")
    assert out.splitlines()[-1].endswith("1 processes; 2 never ran =====")


def test_a_process_that_wrote_no_junit_file_is_not_read_from_the_last_runs(tmp_path, monkeypatch, capsys):
    """A process that crashed before writing its JUnit file, in a log folder a previous run used: that run's file
    (all passed) would answer for its tests; it is removed when the process starts, and its tests never ran."""
    (logs := tmp_path / "logs").mkdir()
    (logs / "lane0.xml").write_text('<testsuites><testsuite tests="1" failures="0" errors="0" skipped="0">'
                                    '<testcase classname="tests.gpu.test_c" name="test_small" time="1"/>'
                                    "</testsuite></testsuites>")  # fmt: skip
    monkeypatch.setattr(run_suite, "PYTEST", [sys.executable, "-c", "import sys; sys.exit(3)"])
    code, out = _main(tmp_path, monkeypatch, capsys, [], needs={"tests/gpu/test_c.py::test_small": 1})
    assert code == 1 and "1 planned test(s) never ran" in out and not (logs / "lane0.xml").exists()


def test_a_filter_that_selects_no_test_fails_the_suite_naming_it(tmp_path, monkeypatch, capsys):
    """`-k` with a typo: every process selected nothing, the suite said "no tests ran" and exited 0. The runner
    collects with the same options as its processes run, so it finds nothing to run and says what selected it."""
    (test_file := tmp_path / "test_gpu_x.py").write_text(
        "import pytest\npytestmark = pytest.mark.gpu\ndef test_engine():\n    pass\n"
    )
    _use_junit_stand_in(tmp_path, monkeypatch, {})  # the processes, if any started, apply -k as pytest does
    code, out = _main(tmp_path, monkeypatch, capsys, ["-k", "no_such_test", str(test_file)])
    assert code != 0
    assert "no GPU test selected" in out and "-k no_such_test" in out and str(test_file) in out


def test_a_suite_whose_every_test_skipped_fails_unless_allowed(tmp_path, monkeypatch, capsys):
    """Every test skipped (no SM90 GPU, no vLLM): nothing was tested, so the suite fails and says why, the skip
    reasons grouped; `--allow-all-skipped` accepts it. Some skipped (the multi-GPU tests on one GPU) is a pass."""
    needs = dict.fromkeys(["tests/gpu/test_d.py::test_engine", "tests/gpu/test_d.py::test_sleep",
                           "tests/gpu/test_c.py::test_small"], 1)  # fmt: skip
    sm90, no_vllm = "skip:needs an SM90 GPU", "skip:no vLLM"
    skip = {"test_engine": sm90, "test_sleep": sm90, "test_small": no_vllm}
    _use_junit_stand_in(tmp_path, monkeypatch, skip)
    code, out = _main(tmp_path, monkeypatch, capsys, [], needs=needs)
    assert code == 1
    assert "every test skipped" in out and "2 x needs an SM90 GPU" in out and "1 x no vLLM" in out
    assert "--allow-all-skipped" in out and out.splitlines()[-1].startswith("===== 3 skipped in ")
    assert _main(tmp_path, monkeypatch, capsys, ["--allow-all-skipped"], needs=needs)[0] == 0
    _use_junit_stand_in(tmp_path, monkeypatch, {**skip, "test_small": "pass"})
    assert _main(tmp_path, monkeypatch, capsys, [], needs=needs)[0] == 0


def _pytest_junit(tmp_path, source: str) -> Path:
    """The JUnit file of real pytest over `tests/gpu/test_x.py` holding `source`, run in `tmp_path`."""
    tests = tmp_path / "tests" / "gpu"
    tests.mkdir(parents=True)
    (tests / "test_x.py").write_text(source)
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={xml}", "tests/gpu"],
                   cwd=tmp_path, capture_output=True)  # fmt: skip
    return xml


def test_tests_in_classes_and_with_odd_ids_are_found_in_the_junit_file(tmp_path):
    """A JUnit case names a test by its module and class (`classname`) and its name with parameters: a memory-check
    failure in a class, or with `::` in a parameter, was missed (not run again alone), and every test is accounted."""
    xml = _pytest_junit(
        tmp_path,
        "import pytest\n"
        "class TestEngine:\n"
        "    def test_start(self):\n"
        "        raise AssertionError('Error in memory profiling. Initial free memory 128.7 GiB')\n"
        "    @pytest.mark.parametrize('where', ['a::b', 'x/y.py'])\n"
        "    def test_where(self, where):\n"
        "        raise AssertionError('Error in memory profiling. Initial free memory 128.7 GiB')\n"
        "def test_plain():\n    pass\n",
    )
    ids = ["tests/gpu/test_x.py::TestEngine::test_start", "tests/gpu/test_x.py::TestEngine::test_where[a::b]",
           "tests/gpu/test_x.py::TestEngine::test_where[x/y.py]", "tests/gpu/test_x.py::test_plain"]  # fmt: skip
    assert run_suite.shared_gpu_failures(xml, ids) == dict.fromkeys(ids[:3], ["failed"])
    assert set(run_suite.junit_cases(xml, ids)) == set(ids)
    assert set(run_suite.junit_cases(xml, [*ids, "tests/gpu/test_x.py::test_gone"])) == set(ids)


def test_junit_counts_and_durations_come_from_pytests_own_file(tmp_path):
    xml = _pytest_junit(
        tmp_path,
        "import time, pytest\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_p(n):\n    time.sleep(0.05)\n"
        "def test_fail():\n    assert False\n"
        "def test_skip():\n    pytest.skip('no GPU')\n"
        "@pytest.mark.xfail(reason='a kernel limit', strict=True)\n"
        "def test_xfail():\n    assert False\n",
    )
    assert run_suite.junit_counts(xml) == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1, "xfailed": 1}
    assert run_suite.summary_line(run_suite.junit_counts(xml)) == "1 failed, 2 passed, 1 skipped, 1 xfailed"
    assert run_suite.skip_reasons([xml]) == {"no GPU": 1}  # an expected failure is no skip
    ids = ["tests/gpu/test_x.py::test_p[1]", "tests/gpu/test_x.py::test_p[2]", "tests/gpu/test_x.py::test_fail",
           "tests/gpu/test_x.py::test_skip"]  # fmt: skip
    durations = run_suite.junit_durations(xml, ids)
    # a skipped test (a two-GPU test on one GPU) keeps the time its last real run recorded
    assert set(durations) == {"tests/gpu/test_x.py::test_p", "tests/gpu/test_x.py::test_fail"}
    assert durations["tests/gpu/test_x.py::test_p"] >= 0.1  # both parametrizations summed
    assert run_suite.junit_counts(tmp_path / "missing.xml") == dict.fromkeys(
        ("passed", "failed", "errors", "skipped", "xfailed"), 0
    )


def test_each_process_reports_a_failure_when_it_happens(tmp_path):
    """A suite cut short (its machine taken back) prints no session summary: the live report (tests/live_report.py,
    loaded by the runner) says which test failed, and why, as soon as it fails, and times each test that ended."""
    tests = tmp_path / "tests" / "gpu"
    tests.mkdir(parents=True)
    (tests / "test_x.py").write_text(
        "def test_fail():\n    assert 1 + 1 == 3, 'the child exited with 1'\ndef test_ok():\n    pass\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "live_report", "-q", "tests/gpu"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)}  # as the runner gives its processes
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env).stdout
    live = out[: out.index("FAILURES")]  # before pytest's own end-of-session report
    assert "FAILED tests/gpu/test_x.py::test_fail (" in live and "the child exited with 1" in live
    assert "PASSED tests/gpu/test_x.py::test_ok (" in live
    assert run_suite.PYTEST[run_suite.PYTEST.index("live_report") - 1] == "-p"  # the runner loads it


def test_the_committed_durations_name_tests_that_exist():
    """durations.json is refreshed from a GPU run's log folder; a renamed test would silently plan at the default."""
    path = run_suite.DURATIONS
    if not path.exists():
        pytest.skip("no durations recorded yet")
    recorded = json.loads(path.read_text())
    root = Path(__file__).resolve().parents[1]
    for function in recorded:
        file, name = function.split("::")
        assert f"def {name}(" in (root / file).read_text(), function


def _pinned(env: dict[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES and TRL_FP8_TEST_GPUS in a process with `env` once it has imported tests/conftest.py."""
    code = "import os, conftest; print(os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('TRL_FP8_TEST_GPUS'))"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(root / "tests")}, cwd=root,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return proc.stdout.split("\n")[-2]


def test_only_pytests_own_process_keeps_one_gpu(monkeypatch):
    """A pytest process keeps the first of its GPUs (Trainer would wrap a model seeing several in DataParallel); a
    rank that a multi-GPU test launches, and which imports test helpers, keeps the GPUs its launcher gave it."""

    from conftest import clean_subprocess_env

    base = {k: v for k, v in os.environ.items() if k not in ("PYTEST_VERSION", "TRL_FP8_TEST_GPUS")}
    runner_job = {**base, "PYTEST_VERSION": "9", "TRL_FP8_TEST_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert _pinned(runner_job) == "2 2,3"
    assert _pinned({**base, "PYTEST_VERSION": "9", "CUDA_VISIBLE_DEVICES": "1,3"}) == "1 1,3"
    monkeypatch.setenv("TRL_FP8_TEST_GPUS", "2,3")
    launched_rank = {**clean_subprocess_env(), "CUDA_VISIBLE_DEVICES": "2,3"}
    assert "PYTEST_VERSION" not in launched_rank and _pinned(launched_rank) == "2,3 None"


def test_a_child_that_hangs_fails_the_test_with_where_it_hangs(tmp_path):
    """`conftest.run_child`: a child past its time fails the test with its output and each thread's Python stack at
    that moment (faulthandler), not with a bare timeout; one that ends returns its stdout and stderr together."""
    from conftest import run_child

    done = run_child([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], timeout=60,
                     env=dict(os.environ))  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["out", "err"]
    hang = "import time\ndef wait_for_the_engine():\n    print('starting', flush=True); time.sleep(600)\nwait_for_the_engine()"
    with pytest.raises(pytest.fail.Exception) as failure:
        run_child([sys.executable, "-c", hang], timeout=3, env=dict(os.environ))
    message = str(failure.value)
    assert "ran past 3 s" in message and "starting" in message
    assert "wait_for_the_engine" in message  # the stack faulthandler printed


def test_an_options_value_is_not_taken_for_a_path():
    """`--deselect ID` (without `=`) ran only the deselected test: its value was read as a path."""
    node = "tests/gpu/test_vllm_server_gpu.py::test_two_trainer_ranks_push_fp8_to_a_two_gpu_server"
    assert run_suite.split_arguments(["--deselect", node, "-x"]) == ([], ["--deselect", node, "-x"])
    assert run_suite.split_arguments(["tests/gpu/test_kernels_gpu.py", "-k", "deepgemm", "--deselect=" + node]) == (
        ["tests/gpu/test_kernels_gpu.py"],
        ["-k", "deepgemm", "--deselect=" + node],
    )
