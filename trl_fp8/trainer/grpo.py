"""`FP8GRPOTrainer`: TRL's `GRPOTrainer` with the FP8 precision flow, FP8 rollouts and export of `FP8TrainerMixin`,
plus what GRPO adds: the trainer-vs-rollout mismatch and token-level TIS.

- `_generate_and_score_completions`: logs the mismatch (`fp8/mismatch/*`) and, where TRL has no importance
  sampling of its own (rollouts with log-probs but without vLLM), adds the token TIS ratio to the batch. With
  `score_in_training_forward` it leaves out TRL's scoring pass (the trainer's log-probs of the whole rollout, without
  gradients, before the micro-batches), and all of this moves to the micro-batches:
- `_compute_loss` / `_get_per_token_logps_and_entropies`: the micro-batch's own forward gives the trainer's log-probs
  (detached), from which the ratio is put in the batch before TRL's loss reads it, and the metrics are logged;
- `_compute_loss`: lets TRL apply the ratio with its own code (and not apply it when TIS is off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from trl import GRPOTrainer

from trl_fp8.trainer.choice import StartUpChoice
from trl_fp8.trainer.config import FP8GRPOConfig
from trl_fp8.trainer.importance_sampling import (
    importance_sampling_ratio,
    mismatch_stats,
    sampling_metrics,
    token_tis_ratio,
)
from trl_fp8.trainer.mixin import FP8TrainerMixin, check_output_dir, say_start_up_choice

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
        self.scoring_in_training_forward = self._choose_scoring()
        if (choice := self.scoring_in_training_forward).automatic:
            say_start_up_choice(self.args, "scoring the rollouts in the training forward", choice.on, choice.reason)
        self._batch_to_score: dict | None = None  # the micro-batch whose training forward gives its log-probs

    def _choose_scoring(self) -> StartUpChoice:
        """Whether the micro-batches' own forwards give the trainer's log-probs of the rollouts
        (`FP8GRPOConfig.score_in_training_forward`), and why."""
        args = self.args
        correcting = self.use_vllm and self.vllm_importance_sampling_correction
        if not (correcting or self._tis_without_vllm or (self.use_vllm and args.log_rollout_mismatch)):
            return StartUpChoice(False, "nothing scores the rollouts with the trainer", automatic=False)
        if args.score_in_training_forward is not None:
            return StartUpChoice(args.score_in_training_forward, "set by score_in_training_forward", automatic=False)
        if not args.rollouts_train_within_one_step():
            return StartUpChoice(False, "a rollout's later micro-batches run on updated weights "
                                 "(gradient_accumulation_steps is not a multiple of steps_per_generation x "
                                 "num_iterations), so the rollout is scored before them")  # fmt: skip
        return StartUpChoice(True, "each micro-batch's own forward gives the trainer's log-probs for the importance "
                             "sampling and the mismatch metrics, the values a scoring pass before the micro-batches "
                             "would give (the same weights), one forward fewer per step; "
                             "score_in_training_forward=False keeps TRL's scoring pass")  # fmt: skip

    def _check_start_up(self, args, trainer_kwargs: dict) -> None:
        if args.tis == "token" and not args.use_vllm and trainer_kwargs.get("rollout_func") is None:
            raise ValueError(
                "tis='token' corrects rollouts sampled by another engine (vLLM, or a rollout_func returning its "
                "log-probs); with use_vllm=False and no rollout_func the policy samples its own rollouts and there is "
                "nothing to correct. Set use_vllm=True, or drop tis."
            )

    def _generate_and_score_completions(self, inputs):
        if self.scoring_in_training_forward.on:
            # TRL leaves out its scoring pass, its ratio and its sampling/* metrics; the micro-batches make them.
            with _attribute_set(self, "vllm_importance_sampling_correction", False):
                return super()._generate_and_score_completions(inputs)
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
        self._log_mismatch(train_logps, rollout_logps, mask, mode)
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
        # (a batch trained on again, num_iterations > 1, keeps the ratio of its first pass: the same weights)
        scored_here = (self.scoring_in_training_forward.on and inputs.get("sampling_per_token_logps") is not None
                       and "importance_sampling_ratio" not in inputs)  # fmt: skip
        self._batch_to_score = inputs if scored_here else None
        try:
            if not (self._tis_without_vllm and (scored_here or "importance_sampling_ratio" in inputs)):
                return super()._compute_loss(model, inputs)
            # TRL multiplies the per-token loss by inputs["importance_sampling_ratio"] when `use_vllm` is set and
            # reads that flag nowhere else in the loss; raising it for this call reuses TRL's code instead of forking
            # the loss.
            with _attribute_set(self, "use_vllm", True):
                return super()._compute_loss(model, inputs)
        finally:
            self._batch_to_score = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        # TRL's loss calls this once, for the policy's log-probs, before it reads the ratio from the batch.
        batch, self._batch_to_score = self._batch_to_score, None
        if batch is not None:
            self._score_in_training_forward(batch, result[0].detach())
        return result

    def _score_in_training_forward(self, batch: dict, train_logps: torch.Tensor) -> None:
        """The micro-batch's ratio (as TRL's scoring pass would have computed it, into `batch`) and its metrics, from
        the trainer's log-probs of its own forward."""
        rollout_logps = batch["sampling_per_token_logps"]
        mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        mode = "train" if self.model.training else "eval"
        if self.vllm_importance_sampling_correction or self._tis_without_vllm:
            is_mode = self.vllm_importance_sampling_mode
            ratio = importance_sampling_ratio(train_logps, rollout_logps, mask, is_mode,
                                              self.vllm_importance_sampling_clip_min,
                                              self.vllm_importance_sampling_clip_max)  # fmt: skip
            batch["importance_sampling_ratio"] = ratio
            per_sequence = is_mode.startswith("sequence")
            metrics = sampling_metrics(train_logps, rollout_logps, mask, ratio, per_sequence, self.accelerator.gather)
            for key, value in metrics.items():
                self._metrics[mode][key].append(value)
        if self.args.log_rollout_mismatch or self._tis_without_vllm:
            self._log_mismatch(train_logps, rollout_logps, mask, mode)

    def _log_mismatch(self, train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, mode: str):
        """`fp8/mismatch/*` of these rollout tokens, over every process (with the TIS clipping where TIS is on)."""
        cap = self.args.tis_cap if self.args.tis == "token" else None
        stats = mismatch_stats(train_logps, rollout_logps, mask, cap, gather=self.accelerator.gather)
        for key, value in stats.items():
            self._metrics[mode][f"fp8/mismatch/{key}"].append(value)


@contextlib.contextmanager
def _attribute_set(obj, name: str, value):
    """Set `obj.name` for the duration of the block and put back whatever was there."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)
