"""An option the trainer settles at start-up where the user left it unset (Liger's kernels, the FP8 KV cache)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StartUpChoice"]


@dataclass(frozen=True)
class StartUpChoice:
    """Whether the option is on (`on`), why (`reason`, for the start-up log), and whether the trainer chose it
    (`automatic`) or the user did."""

    on: bool
    reason: str
    automatic: bool = True
