"""`FP8RLOOTrainer`: TRL's `RLOOTrainer` with the FP8 precision flow, FP8 rollouts and export of `FP8TrainerMixin`.

TRL's RLOO scores every rollout with the trainer and discards the engine's log-probs, so it has no rollout
correction to hook: no TIS and no mismatch metrics here (`FP8GRPOTrainer` has both). What RLOO gets is the rest:
the policy's linear and expert layers in blockwise FP8, vLLM rollouts on the very same FP8 weights and scales
(colocated or on a server, an FP8 KV cache with the trainer's scales), and a block-FP8 checkpoint at `save_model`.
"""

from __future__ import annotations

from trl import RLOOTrainer

from trl_fp8.trainer.config import FP8RLOOConfig
from trl_fp8.trainer.mixin import FP8TrainerMixin

__all__ = ["FP8RLOOTrainer"]


class FP8RLOOTrainer(FP8TrainerMixin, RLOOTrainer):
    """TRL's `RLOOTrainer` whose policy (and reference model) run their linear and expert layers in FP8.

    Takes every argument of `RLOOTrainer` with an `FP8RLOOConfig` as `args`, plus:

    Args:
        fp8_module_filter_fn: `fn(module, fqn) -> bool`; return False to keep a linear layer in BF16.
        tuning: an `FP8Tuning`, the kernel selectors and benchmark knobs whose results are the same either way (None:
            the defaults the measurements chose), e.g. `tuning=FP8Tuning(fuse_swiglu=True)`.

    Raises:
        ValueError: before any model is loaded, for an `output_dir` that is the model's own folder (or inside it)
            and a sharding FP8 cannot follow. ImportError: a reward or kernel whose package is missing.
    """

    _fp8_config_class = FP8RLOOConfig
    _trl_config_name = "RLOOConfig"
    _trl_trainer_module = "trl.trainer.rloo_trainer"
