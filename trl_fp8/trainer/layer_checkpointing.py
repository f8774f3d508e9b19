"""Partial gradient checkpointing under GRPO: transformers' `every_n_layers` (and `offload`) kept across rollouts.

transformers checkpoints only every n-th decoder layer with `activation_checkpointing_kwargs={"every_n_layers": n}`
(`gradient_checkpointing_kwargs` before transformers 5.24; the rest keep their activations: less recomputation where
memory allows, which FP8's smaller saved activations make room for). The Trainer takes those two keys out before the
rest reaches `torch.utils.checkpoint`, but TRL's GRPO turns checkpointing off around its no-grad scoring forward and
back on with the raw dict (`trl.models.utils.disable_gradient_checkpointing`), so the next training forward fails with
"Unexpected keyword arguments: every_n_layers" (TRL 1.16). `keep_layer_options` hands TRL the dict without them and
restores transformers' own selection afterwards. Each of these re-enables also leaves transformers' input-grad hook of
the previous one on the embeddings; `drop_stale_input_grad_hooks` removes those: one hook, however many steps run.
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["LAYER_OPTIONS", "drop_stale_input_grad_hooks", "keep_layer_options", "split_checkpointing_kwargs"]

# Arguments of transformers' `gradient_checkpointing_enable`, not of `torch.utils.checkpoint.checkpoint`.
LAYER_OPTIONS = ("every_n_layers", "offload")
# The name of the forward hook transformers' `enable_input_require_grads` puts on the input embeddings.
INPUT_GRAD_HOOK = "make_inputs_require_grads"


def split_checkpointing_kwargs(kwargs: dict | None) -> tuple[dict | None, dict]:
    """`(what torch.utils.checkpoint takes, transformers' layer options)` from `gradient_checkpointing_kwargs`."""
    kwargs = dict(kwargs or {})
    options = {key: kwargs.pop(key) for key in LAYER_OPTIONS if key in kwargs}
    return kwargs or None, options


# transformers 5.24 renames `gradient_checkpointing_kwargs` to `activation_checkpointing_kwargs` (the old name warns,
# and goes in v6); TRL 1.16 reads the old one. A copy of the args may hold each as a dict of its own.
CHECKPOINTING_KWARGS_NAMES = ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")


@contextlib.contextmanager
def keep_layer_options(model: nn.Module, args):
    """Within the block the args' checkpointing kwargs (under either name) hold only what `torch.utils.checkpoint`
    takes; on the way out, if checkpointing is on, transformers re-applies the layer options (which layers, offload),
    and the input embeddings keep one input-grad hook (`drop_stale_input_grad_hooks`)."""
    originals = {name: getattr(args, name) for name in CHECKPOINTING_KWARGS_NAMES if hasattr(args, name)}
    checkpoint_kwargs, options = None, {}
    for name, original in originals.items():
        kwargs, found = split_checkpointing_kwargs(original)
        if found:
            checkpoint_kwargs, options = kwargs, found
            setattr(args, name, kwargs)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(args, name, original)
        if options and is_checkpointing(model):
            enable_checkpointing(model, checkpoint_kwargs, options)
        drop_stale_input_grad_hooks(model)


# transformers 5.24 renames `gradient_checkpointing*` to `activation_checkpointing*` (the old names warn and go in v6);
# the GPU suite's 5.17 has only the old ones. TRL 1.16 calls the old methods around its no-grad passes: the warnings
# of those calls, which no user can act on.
RENAMED_CHECKPOINTING_CALLS = r"`(is_gradient_checkpointing|gradient_checkpointing_(enable|disable))` is deprecated"


def is_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on (PEFT forwards the attribute to the base model)."""
    new = getattr(model, "is_activation_checkpointing", None)
    return bool(new) if new is not None else bool(getattr(model, "is_gradient_checkpointing", False))


def enable_checkpointing(model: nn.Module, checkpoint_kwargs: dict | None, options: dict) -> None:
    """transformers' checkpointing on, with `torch.utils.checkpoint` arguments and its layer options."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs, **options)


def drop_stale_input_grad_hooks(model: nn.Module) -> int:
    """Remove the input-grad hooks that transformers' `enable_input_require_grads` no longer tracks; returns how many.

    Each enabling of checkpointing (TRL's after every no-grad pass, ours above) registers a new hook on the input
    embeddings and forgets the previous one without removing it (transformers 5.x), so without this the hooks would
    pile up, one more per re-enable, every step."""
    tracked = {handle.id for m in model.modules() for handle in getattr(m, "_require_grads_hooks", None) or ()}
    dropped = 0
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", None) == INPUT_GRAD_HOOK and key not in tracked:
                for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs,
                              module._forward_hooks_always_called):  # fmt: skip
                    hooks.pop(key, None)
                dropped += 1
    return dropped
