"""Trainer callbacks the FP8 trainers add: FSDP2 prefetching set once accelerate has sharded the model, and the
reference model's FP8 weights invalidated where TRL blends the policy into it."""

from __future__ import annotations

import logging
import warnings

from torch import nn
from transformers import TrainerCallback

from trl_fp8.distributed import prefetch_fsdp2_units
from trl_fp8.nn.linear import invalidate_fp8_weights

__all__ = ["InvalidateSyncedReference", "PrefetchFSDP2Units"]

logger = logging.getLogger(__name__)


class PrefetchFSDP2Units(TrainerCallback):
    """`FP8Tuning.fsdp2_prefetch_layers`: set once accelerate has sharded the model (`fully_shard` works in place, so the
    callback's `model` is the sharded one)."""

    def __init__(self, ahead: int):
        self.ahead = ahead

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        units = prefetch_fsdp2_units(model, self.ahead)
        if units == 0:
            warnings.warn(
                f"FP8Tuning(fsdp2_prefetch_layers={self.ahead}) has no effect: the model has no FSDP2 units (accelerate shards "
                "with FSDP2 on GPUs only). Drop it, or launch with an FSDP2 config on GPUs.",
                stacklevel=2,
            )
        elif state.is_world_process_zero:
            logger.info("FSDP2: each of %d layers all-gathers the weights of the next %d ahead", units, self.ahead)


class InvalidateSyncedReference(TrainerCallback):
    """TRL's `sync_ref_model` blends the policy into the reference model in place (`.data.mul_().add_()`), which
    leaves the reference's cached FP8 weights stale; invalidate them on the steps where TRL syncs."""

    def __init__(self, ref_model: nn.Module):
        self.ref_model = ref_model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            invalidate_fp8_weights(self.ref_model)
