"""`FP8GRPOTrainer`: TRL's `GRPOTrainer` with the FP8 precision flow, FP8 rollouts and export of `FP8TrainerMixin`,
plus what GRPO adds: the trainer-vs-rollout mismatch and token-level TIS.

- `_generate_and_score_completions`: logs the mismatch (`fp8/mismatch/*`) and, where TRL has no importance
  sampling of its own (rollouts with log-probs but without vLLM), adds the token TIS ratio to the batch;
- `_compute_loss`: lets TRL apply that ratio with its own code (and not apply it when TIS is off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from trl import GRPOTrainer

from trl_fp8.trainer.config import FP8GRPOConfig
from trl_fp8.trainer.importance_sampling import mismatch_stats, token_tis_ratio
from trl_fp8.trainer.mixin import FP8TrainerMixin, check_output_dir

__all__ = ["FP8GRPOTrainer", "check_output_dir"]


class FP8GRPOTrainer(FP8TrainerMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` whose policy (and reference model) run their linear and expert layers in FP8.

    Takes every argument of `GRPOTrainer` (model name or instance, reward functions, `peft_config`, ...) with an
    `FP8GRPOConfig` as `args`, plus:

    Args:
        fp8_module_filter_fn: `fn(module, fqn) -> bool`; return False to keep a linear layer in BF16 (in training, and
            in the FP8 rollouts and checkpoint of a BF16 run).

    With `peft_config`, the frozen base layers are FP8 and the adapters stay BF16; rollouts and the exported
    checkpoint get the weights merged by PEFT's own merge.

    Raises:
        ValueError: before any model is loaded, for settings that cannot work: an `output_dir` that is the model's
            own folder or inside it (the FP8 checkpoint would replace its weights), `tis="token"` with nothing to
            correct, a sharding FP8 cannot follow. ImportError: a reward or kernel whose package is missing.
    """

    _fp8_config_class = FP8GRPOConfig
    _trl_config_name = "GRPOConfig"
    _trl_trainer_module = "trl.trainer.grpo_trainer"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: FP8GRPOConfig | None = None,
        *trainer_args,
        fp8_module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        **trainer_kwargs,
    ):
        super().__init__(model, reward_funcs, args, *trainer_args, fp8_module_filter_fn=fp8_module_filter_fn,
                         **trainer_kwargs)  # fmt: skip
        # TRL weights the loss by the IS ratio only with vLLM; we extend token TIS to other rollouts with log-probs.
        self._tis_without_vllm = self.args.tis == "token" and not self.use_vllm

    def _check_start_up(self, args, trainer_kwargs: dict) -> None:
        if args.tis == "token" and not args.use_vllm and trainer_kwargs.get("rollout_func") is None:
            raise ValueError(
                "tis='token' corrects rollouts sampled by another engine (vLLM, or a rollout_func returning its "
                "log-probs); with use_vllm=False and no rollout_func the policy samples its own rollouts and there is "
                "nothing to correct. Set use_vllm=True, or drop tis."
            )

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        rollout_logps = output.get("sampling_per_token_logps")
        if rollout_logps is None:
            return output  # rollouts by the trainer's own FP8 model: nothing differs, nothing to correct
        train_logps = output.get("old_per_token_logps")
        if train_logps is None:
            # TRL scores vLLM rollouts with the trainer only when it corrects them; the metrics need one forward.
            if not (self._tis_without_vllm or (self.use_vllm and self.args.log_rollout_mismatch)):
                return output
            train_logps = self._trainer_logps(output, mode)
            if self._tis_without_vllm:
                output["old_per_token_logps"] = train_logps
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        cap = self.args.tis_cap if self.args.tis == "token" else None
        stats = mismatch_stats(train_logps, rollout_logps, mask, cap, gather=self.accelerator.gather)
        for key, value in stats.items():
            self._metrics[mode][f"fp8/mismatch/{key}"].append(value)
        if self._tis_without_vllm:
            output["importance_sampling_ratio"] = token_tis_ratio(
                train_logps, rollout_logps, mask, self.args.tis_cap, self.args.vllm_importance_sampling_clip_min
            )
        return output

    @torch.no_grad()
    def _trainer_logps(self, output, mode) -> torch.Tensor:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, input_ids, attention_mask, output["completion_ids"].size(1), batch_size=batch_size
        )
        return logps

    def _compute_loss(self, model, inputs):
        if not (self._tis_without_vllm and "importance_sampling_ratio" in inputs):
            return super()._compute_loss(model, inputs)
        # TRL multiplies the per-token loss by inputs["importance_sampling_ratio"] when `use_vllm` is set and reads
        # that flag nowhere else in the loss; raising it for this call reuses TRL's code instead of forking the loss.
        with _attribute_set(self, "use_vllm", True):
            return super()._compute_loss(model, inputs)


@contextlib.contextmanager
def _attribute_set(obj, name: str, value):
    """Set `obj.name` for the duration of the block and put back whatever was there."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)
