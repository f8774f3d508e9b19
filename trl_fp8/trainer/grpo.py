"""`FP8GRPOTrainer`: TRL's `GRPOTrainer` with the FP8 precision flow, FP8 rollouts and export of `FP8TrainerMixin`,
plus what GRPO adds: the trainer-vs-rollout mismatch and token-level TIS.

- `_generate_and_score_completions`: logs the mismatch (`fp8/mismatch/*`) and, where TRL has no importance
  sampling of its own (rollouts with log-probs but without vLLM), adds the token TIS ratio to the batch. With
  `score_in_training_forward` it leaves out TRL's scoring pass (the trainer's log-probs of the whole rollout, without
  gradients, before the micro-batches), and all of this moves to the micro-batches:
- `_compute_loss` / `_get_per_token_logps_and_entropies`: the micro-batch's own forward gives the trainer's log-probs
  (detached), from which the ratio is put in the batch before TRL's loss reads it; the metrics' token sums and
  extremes add up over the rollout batch's micro-batches and are logged once, after its last, with the values TRL's
  scoring pass would have logged (`_RolloutScoring`); a micro-batch is scored once, however often it is trained on;
- `_compute_loss`: lets TRL apply the ratio with its own code (and not apply it when TIS is off).

Whether token TIS corrects the rollouts, who applies it, and where the rollouts are scored are the run plan's
decisions (`FP8RunPlan.token_tis`, `FP8RunPlan.scoring_in_training_forward`), read from `self.plan`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from trl import GRPOTrainer

from trl_fp8.plan.choice import TokenTIS
from trl_fp8.plan.choices import rollouts_from_another_engine
from trl_fp8.trainer.grpo_config import TIS_CAP_DEFAULT, FP8GRPOConfig
from trl_fp8.trainer.importance_sampling import (
    TokenSums,
    importance_sampling_ratio,
    mismatch_stats,
    mismatch_stats_of,
    mismatch_sums,
    sampling_metrics_of,
    sampling_sums,
    token_tis_ratio,
)
from trl_fp8.trainer.mixin import FP8TrainerMixin, check_output_dir
from trl_fp8.tuning import FP8Tuning

__all__ = ["FP8GRPOTrainer", "check_output_dir"]

# The mark of a micro-batch its training forward scored: trained on again (num_iterations > 1), it is not scored again.
_SCORED = "trl_fp8_scored_in_training_forward"


class FP8GRPOTrainer(FP8TrainerMixin, GRPOTrainer):
    """TRL's `GRPOTrainer` whose policy (and reference model) run their linear and expert layers in FP8.

    Takes every argument of `GRPOTrainer` (model name or instance, reward functions, `peft_config`, ...) with an
    `FP8GRPOConfig` as `args`, plus:

    Args:
        fp8_module_filter_fn: `fn(module, fqn) -> bool`; return False to keep a linear layer in BF16 (in training, and
            in the FP8 rollouts and checkpoint of a BF16 run).
        tuning: an `FP8Tuning`, the kernel selectors and benchmark knobs whose results are the same either way (None:
            the defaults the measurements chose), e.g. `tuning=FP8Tuning(fuse_swiglu=True)`.

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
        tuning: FP8Tuning | None = None,
        **trainer_kwargs,
    ):
        super().__init__(model, reward_funcs, args, *trainer_args, fp8_module_filter_fn=fp8_module_filter_fn,
                         tuning=tuning, **trainer_kwargs)  # fmt: skip
        self._batch_to_score: dict | None = None  # the micro-batch whose training forward gives its log-probs
        self._rollout_scoring: dict[str, _RolloutScoring] = {}  # per mode: the rollout batch being scored

    @property
    def _token_tis(self) -> TokenTIS | None:
        """Token-level TIS as the plan decided it (None: it corrects nothing in this run)."""
        return self.plan.token_tis.value

    @property
    def _tis_without_vllm(self) -> bool:
        """Token TIS applied by this trainer: TRL weights the loss by the ratio only with vLLM; rollouts that bring
        their own log-probs from a `rollout_func` get it here."""
        return self._token_tis is not None and self._token_tis.by_trainer

    def _check_start_up(self, args, trainer_kwargs: dict) -> None:
        if rollouts_from_another_engine(args, rollout_func=trainer_kwargs.get("rollout_func") is not None):
            return  # (what follows checks TIS options where the policy samples its own rollouts: nothing to correct)
        if args.tis == "token":
            raise ValueError(
                "tis='token' corrects rollouts sampled by another engine (vLLM, or a rollout_func returning its "
                "log-probs); with use_vllm=False and no rollout_func the policy samples its own rollouts and there is "
                "nothing to correct. Set use_vllm=True, or drop tis."
            )
        if args.tis_cap != TIS_CAP_DEFAULT and args.tis_asks_for_token():  # (tis='off' and the like: the config warns)
            warnings.warn(
                f"tis_cap={args.tis_cap} has no effect without token TIS, which has nothing to correct here: with "
                "use_vllm=False and no rollout_func the policy samples its own rollouts. Set use_vllm=True (or pass "
                "a rollout_func that returns its log-probs), or drop tis_cap.",
                stacklevel=4,  # the user's FP8GRPOTrainer(...)
            )

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        if self.plan.scoring_in_training_forward.on:
            self._log_rollout_scoring(mode)  # (a rollout batch not wholly scored: never in TRL's loop; log its part)
            # TRL leaves out its scoring pass, its ratio and its sampling/* metrics; the micro-batches make them.
            with _attribute_set(self, "vllm_importance_sampling_correction", False):
                output = super()._generate_and_score_completions(inputs)
            self._rollout_scoring[mode] = _RolloutScoring(rows_left=len(output["prompt_ids"]))
            return output
        output = super()._generate_and_score_completions(inputs)
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
                train_logps, rollout_logps, mask, self._token_tis.cap, self.args.vllm_importance_sampling_clip_min
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
        # (a batch trained on again, num_iterations > 1, keeps the ratio and the metrics of its first pass: the same
        # weights; TRL hands back the same micro-batch dict, and the mark stays in it with or without a ratio)
        scored_here = (self.plan.scoring_in_training_forward.on and inputs.get("sampling_per_token_logps") is not None
                       and _SCORED not in inputs)  # fmt: skip
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
        """The micro-batch's ratio (as TRL's scoring pass would have computed it, into `batch`), and its part of the
        rollout batch's metrics, from the trainer's log-probs of its own forward; after the rollout batch's last
        micro-batch, its metrics are logged."""
        batch[_SCORED] = True
        rollout_logps = batch["sampling_per_token_logps"]
        mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        mode = "train" if self.model.training else "eval"
        rows = len(batch["prompt_ids"])
        # a batch scored outside TRL's loop (no rollout batch announced) is a rollout batch of its own
        scoring = self._rollout_scoring.setdefault(mode, _RolloutScoring(rows_left=rows))
        if self.vllm_importance_sampling_correction or self._tis_without_vllm:
            is_mode = self.vllm_importance_sampling_mode
            ratio = importance_sampling_ratio(train_logps, rollout_logps, mask, is_mode,
                                              self.vllm_importance_sampling_clip_min,
                                              self.vllm_importance_sampling_clip_max)  # fmt: skip
            batch["importance_sampling_ratio"] = ratio
            scoring.add_sampling(
                sampling_sums(train_logps, rollout_logps, mask, ratio, is_mode.startswith("sequence"))
            )
        if self.args.log_rollout_mismatch or self._tis_without_vllm:
            scoring.add_mismatch(mismatch_sums(train_logps, rollout_logps, mask, self._tis_cap_logged))
        scoring.rows_left -= rows
        if scoring.rows_left <= 0:
            self._log_rollout_scoring(mode)

    def _log_rollout_scoring(self, mode: str) -> None:
        """Log the metrics of the rollout batch the micro-batches scored (one collective each, on every process)."""
        scoring = self._rollout_scoring.pop(mode, None)
        if scoring is None:
            return
        if scoring.sampling is not None:
            for key, value in sampling_metrics_of(scoring.sampling, self.accelerator.gather).items():
                self._metrics[mode][key].append(value)
        if scoring.mismatch is not None:
            self._append_mismatch(mismatch_stats_of(scoring.mismatch, self._tis_cap_logged, self.accelerator.gather),
                                  mode)  # fmt: skip

    @property
    def _tis_cap_logged(self) -> float | None:
        """The cap whose clipped fraction `fp8/mismatch/is_ratio_clipped_frac` reports (token TIS on), else None."""
        return None if self._token_tis is None else self._token_tis.cap

    def _log_mismatch(self, train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, mode: str):
        """`fp8/mismatch/*` of these rollout tokens, over every process (with the TIS clipping where TIS is on)."""
        stats = mismatch_stats(train_logps, rollout_logps, mask, self._tis_cap_logged, self.accelerator.gather)
        self._append_mismatch(stats, mode)

    def _append_mismatch(self, stats: dict[str, float], mode: str) -> None:
        for key, value in stats.items():
            self._metrics[mode][f"fp8/mismatch/{key}"].append(value)


@dataclass
class _RolloutScoring:
    """A rollout batch scored by its micro-batches' training forwards: the rows not scored yet and what the scored
    ones add to the `sampling/*` and `fp8/mismatch/*` metrics, so that they are computed over the whole rollout batch
    as TRL's scoring pass computes them (a mean of micro-batch maxima is not a maximum)."""

    rows_left: int
    sampling: TokenSums | None = None
    mismatch: TokenSums | None = None

    def add_sampling(self, sums: TokenSums) -> None:
        self.sampling = sums if self.sampling is None else self.sampling + sums

    def add_mismatch(self, sums: TokenSums) -> None:
        self.mismatch = sums if self.mismatch is None else self.mismatch + sums


@contextlib.contextmanager
def _attribute_set(obj, name: str, value):
    """Set `obj.name` for the duration of the block and put back whatever was there."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)
