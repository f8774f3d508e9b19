"""Partial gradient checkpointing under GRPO: transformers' `every_n_layers` (and `offload`) kept across rollouts.

transformers checkpoints only every n-th decoder layer with `gradient_checkpointing_kwargs={"every_n_layers": n}`
(the rest keep their activations: less recomputation where memory allows, which FP8's smaller saved activations
make room for). The Trainer takes those two keys out before the rest reaches `torch.utils.checkpoint`, but TRL's
GRPO turns checkpointing off around its no-grad scoring forward and back on with the raw dict
(`trl.models.utils.disable_gradient_checkpointing`), so the next training forward fails with "Unexpected keyword
arguments: every_n_layers" (TRL 1.16). `keep_layer_options` hands TRL the dict without them and restores
transformers' own selection afterwards.
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["LAYER_OPTIONS", "keep_layer_options", "split_checkpointing_kwargs"]

# Arguments of transformers' `gradient_checkpointing_enable`, not of `torch.utils.checkpoint.checkpoint`.
LAYER_OPTIONS = ("every_n_layers", "offload")


def split_checkpointing_kwargs(kwargs: dict | None) -> tuple[dict | None, dict]:
    """`(what torch.utils.checkpoint takes, transformers' layer options)` from `gradient_checkpointing_kwargs`."""
    kwargs = dict(kwargs or {})
    options = {key: kwargs.pop(key) for key in LAYER_OPTIONS if key in kwargs}
    return kwargs or None, options


@contextlib.contextmanager
def keep_layer_options(model: nn.Module, args):
    """Within the block `args.gradient_checkpointing_kwargs` holds only what `torch.utils.checkpoint` takes; on the
    way out, if checkpointing is on, transformers re-applies the layer options (which layers, offload)."""
    checkpoint_kwargs, options = split_checkpointing_kwargs(args.gradient_checkpointing_kwargs)
    if not options:
        yield
        return
    original = args.gradient_checkpointing_kwargs
    args.gradient_checkpointing_kwargs = checkpoint_kwargs
    try:
        yield
    finally:
        args.gradient_checkpointing_kwargs = original
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs, **options)
