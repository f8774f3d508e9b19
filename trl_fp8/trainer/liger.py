"""Liger's layer kernels by default: `use_liger_kernel=None` is decided at start-up, from the model and the machine.

Liger's fused RMSNorm, RoPE and SwiGLU take the part of the training phase that FP8 layers leave in BF16
(elementwise kernels and reductions, a large share of it at the 8B shape: docs/benchmarks.md, "GRPO at 64 x 1k:
backends, weight cache, profile"), so they pay most beside FP8 GEMMs. Measured with TRL's `use_liger_kernel=True` on
Qwen3 shapes, with and without them: docs/benchmarks.md, "GRPO with Liger's kernels, compiled layers and the
fusions", and for the 8B GRPO step at TRL's colocate defaults that chose the default, docs/engineering-notes.md,
"One H100, 2026-11-26: with and without Liger's kernels". They are put on the model exactly as that option does
(transformers' `apply_liger_kernel` when training starts, TRL's `liger_kernel_config`), where that is what was
measured: a dense decoder of a family whose layers Liger patches with these three kernels, trained on a CUDA GPU,
with liger-kernel installed.
"""

from __future__ import annotations

import contextlib
import sys
from types import ModuleType

from torch import nn

from trl_fp8.config import BLOCKWISE
from trl_fp8.nn.adapters import unwrap_model
from trl_fp8.trainer.choice import StartUpChoice

__all__ = ["LIGER_DENSE_MODEL_TYPES", "choose_liger_kernels", "liger_patches_kept_on_the_model"]

# Dense decoders whose RMSNorm, RoPE and SwiGLU MLP Liger replaces (liger_kernel.transformers'
# `apply_liger_kernel_to_*`), with the MLP's gate/up/down projections kept as modules our FP8 layers replace.
# Mixture-of-experts types stay out: Liger's patches of their expert MLPs were never run with FP8 experts.
LIGER_DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def choose_liger_kernels(model_type: str | None, args, *, cuda: bool) -> StartUpChoice:
    """The run's `use_liger_kernel`: the user's where set; else on for a dense model of `LIGER_DENSE_MODEL_TYPES`
    trained on a CUDA GPU (`cuda`) with liger-kernel installed, in blockwise FP8 or BF16, outside compiled decoder
    layers (torchao's recipes are not yet measured with them; compiled layers with them were slower)."""
    from transformers.utils import is_liger_kernel_available

    if args.use_liger_kernel is not None:
        return StartUpChoice(bool(args.use_liger_kernel), "set by use_liger_kernel", automatic=False)
    if not cuda:
        return StartUpChoice(False, "no CUDA GPU to train on (Liger's kernels are Triton kernels)")
    if model_type not in LIGER_DENSE_MODEL_TYPES:
        return StartUpChoice(
            False,
            f"model type {model_type!r} is not one of the dense decoders they are used on "
            f"({', '.join(LIGER_DENSE_MODEL_TYPES)}); use_liger_kernel=True puts them on anyway",
        )
    if args.fp8_recipe not in (BLOCKWISE, None):
        return StartUpChoice(False, f"torchao's {args.fp8_recipe!r} recipe is not measured with them yet")
    if args.compile_decoder_layers:
        return StartUpChoice(
            False,
            "compile_decoder_layers compiles the layers instead (Liger's kernels inside compiled layers ran "
            "the 8B GRPO step slower than Liger's alone: docs/when-fp8-pays.md)",
        )
    if not is_liger_kernel_available():
        return StartUpChoice(
            False, "liger-kernel is not installed: pip install 'trl-fp8[liger]' for a faster training phase"
        )
    reason = "their fused RMSNorm, RoPE and SwiGLU take the training phase's BF16 work beside the FP8 GEMMs"
    if args.fp8_fuse_swiglu:
        reason += " (SwiGLU left to fp8_fuse_swiglu)"
    return StartUpChoice(True, reason + "; use_liger_kernel=False turns them off")


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
