"""The run's plan: every start-up decision in one room (`FP8RunPlan`), made by pure functions of the run's settings,
the model's config and the machine (`plan.choices`, `plan.micro_batch`), for the trainer and `trl-fp8 plan` alike."""

from trl_fp8.plan.choice import Choice, TokenTIS, WeightCache
from trl_fp8.plan.run_plan import FP8RunPlan
from trl_fp8.rollout.settings import RolloutSettings

__all__ = ["Choice", "FP8RunPlan", "RolloutSettings", "TokenTIS", "WeightCache"]
