"""Liger's kernels kept on the trained model only: transformers puts them on when training starts (where the run's plan
turned them on, `trl_fp8.plan.choices.choose_liger_kernels`), and they would otherwise stay on the model family's
modeling module for every model built later in the process.
"""

from __future__ import annotations

import contextlib
import sys
from types import ModuleType

from torch import nn

from trl_fp8.nn.adapters import unwrap_model

__all__ = ["liger_patches_kept_on_the_model", "modeling_module"]


def modeling_module(model: nn.Module) -> ModuleType | None:
    """The transformers modeling module of `model`'s class (DDP and PEFT wrappers looked through by `unwrap_model`,
    FSDP2's through the class's bases), or None."""
    for cls in type(unwrap_model(model)).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return sys.modules.get(cls.__module__)
    return None


@contextlib.contextmanager
def liger_patches_kept_on_the_model(model: nn.Module):
    """Around `Trainer.train()`, where transformers puts Liger's kernels on the model: Liger also replaces names of the
    model's modeling module (`apply_liger_kernel_to_qwen3` sets `modeling_qwen3.Qwen3RMSNorm`, `Qwen3MLP` and
    `apply_rotary_pos_emb`), so every model of that family built later in the process would get Triton kernels, which
    fail on CPU (a saved model reloaded for evaluation). On exit the module gets its own names back: the trained model
    keeps Liger's RMSNorm and SwiGLU modules, and its RoPE is transformers' again (the same function)."""
    module = modeling_module(model)
    if module is None:
        yield
        return
    before = dict(vars(module))
    try:
        yield
    finally:
        now = vars(module)
        for name in [name for name in now if name not in before]:
            delattr(module, name)
        for name, value in before.items():
            if now.get(name) is not value:
                setattr(module, name, value)
