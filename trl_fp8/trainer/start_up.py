"""What the trainers check before the model loads, so that a run that could not train stops at once, in one line
naming the fix.

transformers finds a Hub id it cannot download after retrying, in a long traceback.
"""

from __future__ import annotations

from trl_fp8.hub import unavailable_model

__all__ = ["check_model_sources"]


def check_model_sources(model, reward_funcs, args) -> None:
    """Refuse, before loading, a model named by path or Hub id that cannot be loaded here (`unavailable_model`): the
    policy, and the reward models TRL loads by name (with the same `model_init_kwargs`)."""
    names = [model, *(reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])]
    revision = (args.model_init_kwargs or {}).get("revision")
    for name in names:
        if isinstance(name, str) and (problem := unavailable_model(name, revision)):
            raise ValueError(problem)
