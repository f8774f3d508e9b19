"""A decision of the run's plan (`Choice`: the user's setting, or what the trainer settled where it was left unset),
and the start-up lines that say it, once per run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Choice", "TokenTIS", "WeightCache", "say_start_up", "say_start_up_choice"]


@dataclass(frozen=True)
class Choice:
    """What was chosen (`value`), why (`reason`, for the start-up log), and whether the trainer chose it
    (`automatic`) or the user did."""

    value: Any
    reason: str
    automatic: bool = True

    @property
    def on(self) -> bool:
        """Whether the option is on (a value that is off is falsy)."""
        return bool(self.value)


@dataclass(frozen=True)
class WeightCache:
    """The FP8 weight cache's value: whether FP8 layers keep their quantized weights between forwards (`cache`), and
    whether they keep them through the training micro-batches too (`with_grad`, `FP8LinearConfig.cache_with_grad`:
    False holds them for the forwards without gradients only; None where there is no cache)."""

    cache: bool
    with_grad: bool | None = None

    def __post_init__(self):
        if self.cache and self.with_grad is None:
            raise ValueError("WeightCache(cache=True) needs with_grad: whether the micro-batches keep it too.")

    def __bool__(self) -> bool:
        return self.cache


@dataclass(frozen=True)
class TokenTIS:
    """Token-level truncated importance sampling as a run applies it: each token's ratio pi_train / pi_rollout capped
    at `cap`, by TRL's own loss code for vLLM rollouts, or by the trainer itself (`by_trainer`: rollouts that bring
    their own log-probs without vLLM, where TRL has no importance sampling)."""

    cap: float
    by_trainer: bool = False


def say_start_up(args, text: str) -> None:
    """A start-up line, said once (by the first process)."""
    if args.process_index == 0:
        print(f"[trl-fp8] {text}.", flush=True)


def say_start_up_choice(args, what: str, on: bool, reason: str) -> None:
    """A start-up choice the user did not make, said once with its reason."""
    say_start_up(args, f"{what} {'on' if on else 'off'}: {reason}")
