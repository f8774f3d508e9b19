"""Reward functions named on the command line, resolved as TRL's own GRPO script (`trl grpo`) resolves them."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable


def trl_reward_registry() -> dict[str, Callable]:
    """The names `trl grpo --reward_funcs` takes, bound to the same functions and settings as TRL's script."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }


def resolve_reward_funcs(names: list[str] | None, reward_model_name_or_path: str | None = None) -> list:
    """`--reward_model_name_or_path` and `--reward_funcs` as TRL's GRPO script takes them: a reward model first (a
    Hub id or folder, which GRPOTrainer loads), then each name of TRL's registry or a dotted import path
    `package.module.function` (imported with the working directory on the path, as TRL does).

    Raises:
        ValueError: for a name that is neither, naming the accepted forms.
    """
    registry = trl_reward_registry()
    funcs: list = [reward_model_name_or_path] if reward_model_name_or_path else []
    for name in names or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name and "/" not in name:
            funcs.append(_import_function(name))
        else:
            raise ValueError(
                f"--reward_funcs {name!r} is neither one of TRL's rewards ({', '.join(registry)}) nor an import path "
                "'package.module.function'. A reward model goes in --reward_model_name_or_path."
            )
    return funcs


def _import_function(path: str) -> Callable:
    module_path, attr = path.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as TRL's script: modules next to where the run starts
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ValueError(f"--reward_funcs {path!r}: cannot import {module_path!r} ({exc}).") from exc
    func = getattr(module, attr, None)
    if not callable(func):
        raise ValueError(f"--reward_funcs {path!r}: {module_path!r} has no function {attr!r}.")
    return func
