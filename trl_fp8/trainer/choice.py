"""An option the trainer settles at start-up where the user left it unset (Liger's kernels, the FP8 KV cache), and
the start-up lines that say it, once per run."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StartUpChoice", "say_start_up", "say_start_up_choice"]


@dataclass(frozen=True)
class StartUpChoice:
    """Whether the option is on (`on`), why (`reason`, for the start-up log), and whether the trainer chose it
    (`automatic`) or the user did."""

    on: bool
    reason: str
    automatic: bool = True


def say_start_up(args, text: str) -> None:
    """A start-up line, said once (by the first process)."""
    if args.process_index == 0:
        print(f"[trl-fp8] {text}.", flush=True)


def say_start_up_choice(args, what: str, on: bool, reason: str) -> None:
    """A start-up choice the user did not make, said once with its reason."""
    say_start_up(args, f"{what} {'on' if on else 'off'}: {reason}")
