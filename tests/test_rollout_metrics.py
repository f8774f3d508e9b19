"""The rollout metrics (`sampling/*`, `fp8/mismatch/*`) mean the same whichever pass gives the trainer's log-probs:
TRL's scoring pass before the micro-batches, or the micro-batches' own training forwards (`score_in_training_forward`,
the default). Same model, same rollouts both ways (vLLM replaced by a `rollout_func` sampling from another model, so
the two policies differ a lot: ratios far from 1, sequences dropped by `sequence_mask`)."""

import math

import pytest

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward

from fake_vllm import sampling_rollout_func

ROLLOUT_METRICS = ("sampling/", "fp8/mismatch/")


def run_one_step(tmp_path, score_in_training_forward: bool, **settings) -> dict[str, float]:
    """The log of one optimizer step of 8 micro-batches of 4 rows: two rollout batches of 16 (steps_per_generation=4;
    at num_iterations=2, one, trained on twice), rollouts sampled from a model of another seed, trained on a tiny FP8
    Qwen3 with vLLM colocated (fake)."""
    tokenizer = tiny_char_tokenizer()
    ids = dict(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    sampler = tiny_qwen3(seed=1, **ids)
    step = dict(
        num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=8, steps_per_generation=4
    )
    args = FP8GRPOConfig(**{**GRPO_SETTINGS, **step, **settings}, output_dir=str(tmp_path), max_steps=1,
                         logging_steps=1, use_cpu=True, bf16=False, disable_tqdm=True, use_vllm=True,
                         vllm_mode="colocate", score_in_training_forward=score_in_training_forward)  # fmt: skip
    trainer = FP8GRPOTrainer(tiny_qwen3(seed=0, **ids), say_letter_reward, args, train_dataset=say_letter_dataset(64),
                             processing_class=tokenizer,
                             rollout_func=sampling_rollout_func(tokenizer, lambda trainer: sampler))  # fmt: skip
    assert trainer.plan.scoring_in_training_forward.on is score_in_training_forward
    trainer.train()
    (log,) = [log for log in trainer.state.log_history if "loss" in log]
    return log


SETTINGS = {
    "sequence_mask": {"tis": None},  # TRL's own default: sequence_mask
    "token_tis": {"tis": "token"},
    "token_mask_truncated_masked": {"tis": None, "mask_truncated_completions": True,
                                    "vllm_importance_sampling_mode": "token_mask"},
    "tis_off": {"tis": "off"},  # no ratio: the mismatch metrics alone
    "trl_correction_off": {"tis": None, "vllm_importance_sampling_correction": False},
}  # fmt: skip
ITERATED_ONCE = ("sequence_mask", "token_tis", "token_mask_truncated_masked")
ITERATED_TWICE = ("sequence_mask", "token_tis", "tis_off", "trl_correction_off")  # (each TIS setting)


@pytest.mark.parametrize(
    "name, num_iterations",
    [(name, 1) for name in ITERATED_ONCE] + [(name, 2) for name in ITERATED_TWICE],
    ids=[f"{name}-iterations1" for name in ITERATED_ONCE] + [f"{name}-iterations2" for name in ITERATED_TWICE],
)
def test_both_scoring_paths_log_the_same_rollout_metrics(fake_vllm, tmp_path, name, num_iterations):
    """At `num_iterations=2` the rollout batch's 4 micro-batches are trained on twice in the step (the same weights):
    the metrics are still the rollout batch's, logged once, whether a ratio was put in the batch or not."""
    settings = {**SETTINGS[name], "num_iterations": num_iterations}
    scoring_pass = run_one_step(tmp_path / "pass", False, **settings)
    in_forward = run_one_step(tmp_path / "forward", True, **settings)
    assert scoring_pass["reward"] == in_forward["reward"]  # the same rollouts
    keys = sorted(k for k in scoring_pass if k.startswith(ROLLOUT_METRICS))
    corrected = SETTINGS[name].get("tis") != "off" and SETTINGS[name].get("vllm_importance_sampling_correction", True)
    assert ("sampling/importance_sampling_ratio/max" in keys) is bool(corrected) and "fp8/mismatch/kl_k3" in keys
    assert sorted(k for k in in_forward if k.startswith(ROLLOUT_METRICS)) == keys
    assert scoring_pass["fp8/mismatch/abs_logp_diff_mean"] > 0.1  # policies far apart: extremes are far from means
    for key in keys:
        assert math.isclose(in_forward[key], scoring_pass[key], rel_tol=1e-4, abs_tol=1e-6), (
            key, in_forward[key], scoring_pass[key])  # fmt: skip


def test_a_rollout_batch_is_logged_once_after_its_last_micro_batch(fake_vllm, tmp_path, monkeypatch):
    """Metrics of micro-batches are not averaged as values: the max logged is the largest, the min the smallest."""
    from trl_fp8.trainer import grpo

    appended = []
    real = grpo.FP8GRPOTrainer._log_rollout_scoring
    monkeypatch.setattr(grpo.FP8GRPOTrainer, "_log_rollout_scoring",
                        lambda self, mode: appended.append(mode in self._rollout_scoring) or real(self, mode))  # fmt: skip
    run_one_step(tmp_path, True, tis="token")
    assert appended.count(True) == 2  # two rollout batches, each logged once (8 micro-batches scored)
