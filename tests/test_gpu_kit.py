"""The GPU kit's host side (`tests/gpu/kit/setup.sh`): `start` runs a command in the background on the staged stack,
`wait` follows it and brings back what it wrote. Run here on a kit of one fake part whose stack counts as unpacked."""

import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

KIT = Path(__file__).parent / "gpu" / "kit"

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the kit runs under bash")


def write_kit(root: Path, parts: int) -> None:
    """The kit of stack `test` as `build-kit.sh` writes its `setup.sh`, expecting `parts` parts, with one present."""
    kit = root / ".gpu-test"
    (kit / "p00").mkdir(parents=True, exist_ok=True)
    (kit / "p00" / "part00").write_bytes(b"x")
    template = (KIT / "setup.sh").read_text()
    (kit / "setup.sh").write_text(template.replace("@STACK@", "test").replace("@PARTS@", str(parts)))


@pytest.fixture
def project(tmp_path):
    """A project root holding a kit of stack `test` (one part) and the folders the kit keeps its state in."""
    root = tmp_path / "project"
    write_kit(root, parts=1)
    (root / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "1"\n')
    (root / "data.txt").write_text("from the tree")
    env = {**os.environ, "KIT_VAR_DIR": str(tmp_path / "var"), "KIT_TMP_DIR": str(tmp_path / "tmp"),
           "OUT": str(tmp_path / "out")}  # fmt: skip
    (tmp_path / "tmp" / "site-test").mkdir(parents=True)
    (tmp_path / "tmp" / "site-test" / ".complete").touch()  # unpacked already: nothing to decompress
    (tmp_path / "out").mkdir()
    return root, env


def kit(root, env, *args):
    return subprocess.run(["bash", ".gpu-test/setup.sh", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_wait_on_a_host_where_nothing_started_says_so(project):
    root, env = project
    result = kit(root, env, "wait", "1")
    assert result.returncode == 3
    assert "nothing was started on this host" in result.stderr


def test_start_needs_every_part_staged(project):
    root, env = project
    write_kit(root, parts=2)
    result = kit(root, env, "start", "true")
    assert result.returncode == 1 and "the 2 parts staged (1 are)" in result.stderr
    assert not (Path(env["KIT_VAR_DIR"]) / "run-test").exists()


def test_a_started_run_ends_with_its_status_and_brings_back_what_it_wrote(project):
    root, env = project
    assert "1 of 1 parts staged" in kit(root, env, "stage").stdout
    started = time.monotonic()
    result = kit(root, env, "start", 'sleep 2; cp data.txt "$RUN_OUT/copied.txt"; echo "$HF_HUB_OFFLINE"; exit 4')
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 2  # returns at once, the run goes on
    (root / "data.txt").write_text("changed after the start")  # the run has a copy of the tree
    again = kit(root, env, "start", "true")
    assert again.returncode == 1 and "a run is going on" in again.stderr
    result = kit(root, env, "wait", "60")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "the run ended, rc=4" in result.stdout
    out = Path(env["OUT"])
    assert sorted(p.name for p in out.iterdir()) == ["command", "end", "out.log", "run-out.tar.gz"]
    assert (out / "out.log").read_text().strip().endswith("1")  # HF_HUB_OFFLINE=1, printed by the command
    with tarfile.open(out / "run-out.tar.gz") as archive:  # $RUN_OUT, whatever the number of files
        archive.extractall(out / "run", filter="data")
    assert (out / "run" / "copied.txt").read_text() == "from the tree"
    versions = (out / "run" / "versions.txt").read_text()  # `python3 -m trl_fp8 --version`
    assert versions.startswith("trl-fp8 ") and "torch" in versions


def test_wait_returns_while_the_run_goes_on(project):
    root, env = project
    kit(root, env, "stage")
    assert kit(root, env, "start", "sleep 30").returncode == 0
    try:
        result = kit(root, env, "wait", "1")
        assert result.returncode == 0 and "the run goes on" in result.stdout
    finally:
        pid = int((Path(env["KIT_VAR_DIR"]) / "run-test" / "job.pid").read_text())
        os.killpg(pid, 15)  # the job leads a session (and process group) of its own
