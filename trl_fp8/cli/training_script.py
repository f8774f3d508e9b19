"""What a training script (`examples/grpo_fp8.py`) adds to TRL's script helpers: its start-up refusals end the
output in one `error:` line, and `--resume_from_checkpoint true` resumes from the last checkpoint in `output_dir`.

`HfArgumentParser` prints the usage of every flag (hundreds of lines) before an argparse error, and a refusal raised
as an exception ends in a traceback. Under `accelerate launch`, accelerate then reports the script's non-zero exit
with a traceback of its own (`subprocess.CalledProcessError`) unless it is given `-q`: that one the script cannot
leave out, since its exit code must stay non-zero.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

__all__ = ["SHORT_USAGE", "UsageError", "refusals_in_one_line", "resume_checkpoint"]

SHORT_USAGE = "%(prog)s [--flag value ...]  (--help lists every flag; --config run.yaml reads them from a file)"

_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


class UsageError(ValueError):
    """A script's refusal of its command line: `refusals_in_one_line` prints it as one line."""


@contextlib.contextmanager
def refusals_in_one_line():
    """Around a script's start-up (parsing, loading, building the trainer): a `UsageError`, or a ValueError or
    ImportError raised by trl-fp8's own checks (each names its fix), ends the process with `error: <message>` as the
    last line of stderr and exit code 2, as argparse does. Any other exception keeps its traceback: a failure that
    is not a refusal needs it."""
    try:
        yield
    except (ValueError, ImportError) as exc:
        if not (isinstance(exc, UsageError) or _raised_by_trl_fp8(exc)) or isinstance(exc, ModuleNotFoundError):
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _raised_by_trl_fp8(exc: BaseException) -> bool:
    """Whether the frame that raised `exc` is trl-fp8's code (its refusals), not TRL's, transformers' or torch's."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def resume_checkpoint(value, output_dir: str) -> str | None:
    """The checkpoint folder `--resume_from_checkpoint` names: `true` the last `checkpoint-N` in `output_dir` (what
    transformers' `Trainer.train(resume_from_checkpoint=True)` resumes from), `false` or unset none, else the path.

    Raises:
        UsageError: `true` with no checkpoint in `output_dir`, or a path that is not a folder, before anything loads.
    """
    from transformers.trainer_utils import get_last_checkpoint

    if value is None or value is False or str(value).lower() == "false":
        return None
    if value is True or str(value).lower() == "true":
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise UsageError(
                f"--resume_from_checkpoint true resumes from the last checkpoint-N folder in output_dir {output_dir}, "
                "and it holds none: drop the flag to start afresh, or pass --output_dir of the run to resume (or the "
                "checkpoint folder itself)."
            )
        return last
    if not os.path.isdir(value):
        raise UsageError(
            f"--resume_from_checkpoint {value}: no checkpoint folder there. Pass a checkpoint-N folder of an earlier "
            "run, or true for the last one in --output_dir."
        )
    return value
