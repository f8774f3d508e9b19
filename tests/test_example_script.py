"""`examples/grpo_fp8.py` as a user runs it: its refusals end the output in one `error:` line (no argparse usage
dump, no traceback), also under `accelerate launch -q`; `--resume_from_checkpoint true` resumes from the last
checkpoint in `output_dir`, as transformers users expect."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S, clean_subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "grpo_fp8.py"
SINGLE_PROCESS = ROOT / "examples" / "accelerate_configs" / "single_process.yaml"


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**clean_subprocess_env(), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)


def ends_in_one_error_line(proc: subprocess.CompletedProcess, message: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and lines, proc.stderr
    assert lines[-1].startswith(f"error: {message}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) < 10, proc.stderr[-3000:]  # no usage dump, no traceback


def test_an_unknown_flag_under_accelerate_launch_quiet_ends_in_one_line(model_dir, tmp_path):
    """accelerate's launcher reports a child's non-zero exit with a traceback of its own unless `-q` is given
    (`simple_launcher`); with it, the script's line is the last."""
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file", str(SINGLE_PROCESS),
                str(SCRIPT), "--model_name_or_path", model_dir, "--dataset_name", str(tmp_path), "--output_dir",
                str(tmp_path / "out"), "--use_cpu", "true", "--bf16", "false", "--fp8_recipee", "blockwise"])  # fmt: skip
    ends_in_one_error_line(proc, "unrecognized arguments: --fp8_recipee blockwise")
    assert "--help lists every flag" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_resume_from_checkpoint_true_resumes_from_the_last_checkpoint_in_output_dir(tmp_path):
    from trl_fp8.cli.training_script import resume_checkpoint

    out = tmp_path / "out"
    for step in (2, 10, 9):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    for value in ("true", "True", True):
        assert resume_checkpoint(value, str(out)) == str(out / "checkpoint-10")
    for value in (None, "false", "False", False):
        assert resume_checkpoint(value, str(out)) is None
    assert resume_checkpoint(str(out / "checkpoint-2"), str(out)) == str(out / "checkpoint-2")
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint .*checkpoint-3: no checkpoint folder there"):
        resume_checkpoint(str(out / "checkpoint-3"), str(out))


def test_resume_from_checkpoint_true_without_a_checkpoint_stops_before_anything_runs(tmp_path):
    out = tmp_path / "demo"
    proc = run([sys.executable, str(SCRIPT), "--resume_from_checkpoint", "true", "--output_dir", str(out)])
    ends_in_one_error_line(proc, f"--resume_from_checkpoint true resumes from the last checkpoint-N folder in "
                                 f"output_dir {out}, and it holds none")  # fmt: skip
    assert proc.returncode == 2
    assert not out.exists() and not Path(f"{out}_initial_model").exists()  # the demo's warm start did not run
