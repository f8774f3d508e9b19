"""Packages a setting needs, checked when the config or the trainer is built: transformers and TRL find out only
when training starts or at the first reward, after the model has loaded and the vLLM engine has started."""

from __future__ import annotations

__all__ = [
    "check_liger_installed",
    "check_optimizer_installed",
    "check_reward_dependencies",
    "is_bitsandbytes_optimizer",
]


def check_liger_installed() -> None:
    """Refuse `use_liger_kernel=True` without liger-kernel now, not when training starts (after the model loads)."""
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        raise ImportError(
            "use_liger_kernel=True puts Liger's kernels on the model, and liger-kernel is not installed: "
            "pip install 'trl-fp8[liger]' (a CUDA GPU is needed to run them), or drop use_liger_kernel."
        )


def is_bitsandbytes_optimizer(optim) -> bool:
    """Whether transformers runs `optim` (a name or `OptimizerNames`) on bitsandbytes (False with a transformers
    that moved its list: it still checks when training starts)."""
    try:
        from transformers.trainer_optimizer import _BITSANDBYTES_OPTIMIZERS
    except ImportError:
        return False
    return optim in _BITSANDBYTES_OPTIMIZERS


def check_optimizer_installed(optim) -> None:
    """Refuse a bitsandbytes optimizer without bitsandbytes now: transformers only finds out when training starts,
    after the model has loaded and the vLLM engine has started (minutes with a cold DeepGEMM cache)."""
    from transformers.utils import is_bitsandbytes_available

    if is_bitsandbytes_optimizer(optim) and not is_bitsandbytes_available():
        name = getattr(optim, "value", optim)
        raise ImportError(
            f"optim={name!r} is a bitsandbytes optimizer, and bitsandbytes is not installed: "
            "pip install 'trl-fp8[bnb]', or choose another optimizer (optim='adamw_torch_fused')."
        )


def check_reward_dependencies(reward_funcs) -> None:
    """TRL's math rewards need math-verify, and only import it at the first reward call: after the model has
    loaded, the engine has started and the first rollout ran. Refuse now instead."""
    from trl.import_utils import is_math_verify_available
    from trl.rewards import accuracy_reward, reasoning_accuracy_reward

    funcs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    needs = [f.__name__ for f in funcs if f in (accuracy_reward, reasoning_accuracy_reward)]
    if needs and not is_math_verify_available():
        raise ImportError(
            f"{needs[0]} (trl.rewards) checks answers with math-verify, which is not installed: "
            "pip install 'trl-fp8[math]'."
        )
