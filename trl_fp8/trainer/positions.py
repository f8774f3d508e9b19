"""Each sequence's own positions in the trainer's forwards, as the rollout engine counted them.

TRL left-pads the prompts of a batch and scores it without position ids, so transformers numbers every row from the
batch's first column: a prompt padded by p tokens has its tokens at positions p, p + 1, ... in the trainer, while
vLLM (and transformers' own `generate`) put its first token at 0. Rotary embeddings depend on relative positions
only in exact arithmetic; in BF16 the cosines and sines of the shifted angles round differently, and the trainer's
log-probs of a padded sequence move away from the rollout's by far more than the padding itself costs (on a small
random Qwen3, tests/test_sequence_positions.py: 0.05 against at most 0.0002 in mean |dlogp|).

`sequence_positions` numbers each row from its first unmasked token; `positions_from_mask` gives them to every
forward of a model that is given an attention mask and no position ids.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

__all__ = ["positions_from_mask", "sequence_positions", "takes_sequence_positions"]


def sequence_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting each row's unmasked tokens from 0 (left padding skipped; the padding's own positions,
    masked anyway, are 0 before the first token and repeat the last one after it)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def takes_sequence_positions(model: nn.Module) -> bool:
    """Whether the model's forward takes 1-D position ids per row: a text decoder whose forward has `position_ids`.
    Multimodal models (a vision or audio tower) number their tokens themselves (Qwen2-VL's 3-D rotary positions),
    from the same attention mask."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config")):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model passes them on
    return "position_ids" in inspect.signature(base.forward).parameters


@contextlib.contextmanager
def positions_from_mask(model: nn.Module, on: bool = True):
    """While active, each forward of `model` called with a 2-D `attention_mask` and no `position_ids` gets
    `sequence_positions(attention_mask)` as its position ids. A wrapper (DDP, PEFT) passes them on to the model."""
    if not on:
        yield
        return

    def add_positions(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is not None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return None
        return args, {**kwargs, "position_ids": sequence_positions(mask)}

    handle = model.register_forward_pre_hook(add_positions, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
