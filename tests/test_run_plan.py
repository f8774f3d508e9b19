"""`FP8RunPlan`: the run's decisions made once, read by the trainer, never written into the user's args."""

import copy
import dataclasses

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3, tiny_qwen3_config
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
from trl_fp8.plan import Choice, FP8RunPlan, RolloutSettings, WeightCache


def _fields(args) -> dict:
    """Every dataclass field of `args` as the user's object holds it, deep-copied."""
    return copy.deepcopy({f.name: getattr(args, f.name) for f in dataclasses.fields(args)})


def test_the_trainer_leaves_the_users_args_as_given(fake_vllm, tmp_path):
    """Every automatic choice (Liger's kernels, the FP8 KV cache and weight cache) is settled in the plan and handed
    to TRL through the trainer's own copy of the args: the user's object is not changed by the trainer, nor by TRL
    (which adds to the copy's `liger_kernel_config`, `gradient_checkpointing_kwargs` and the like)."""
    tokenizer = tiny_char_tokenizer()
    model = tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    args = FP8GRPOConfig(**{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path),
                         use_cpu=True, bf16=False, use_vllm=True, vllm_mode="colocate")  # fmt: skip
    before = _fields(args)
    trainer = FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                             processing_class=tokenizer)  # fmt: skip
    assert trainer.args is not args
    after = _fields(args)
    changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not changed and after.keys() == before.keys()
    # the unset options stay unset for the user; the trainer's copy holds what was chosen
    assert args.use_liger_kernel is None and args.fp8_kv_cache is None
    assert trainer.args.use_liger_kernel is False and trainer.args.fp8_kv_cache is False
    assert trainer.plan.fp8_weight_cache == Choice(WeightCache(True, with_grad=True),
                                                   "training on cpu, no GPU memory to keep")  # fmt: skip
    assert trainer.vllm_generation.settings == trainer.plan.rollout


def test_the_plan_is_made_from_the_settings_and_the_config_alone(fake_vllm, tmp_path):
    """The same settings and model config make the same plan (the choices, their reasons, the rollout settings)."""
    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_last_layers_in_bf16=1,
                         vllm_fp8_backend="triton", rollout_precision="fp8", use_vllm=True)  # fmt: skip
    first, second = FP8RunPlan.build(args, tiny_qwen3_config()), FP8RunPlan.build(args, tiny_qwen3_config())
    assert first == second
    assert first.layers.num_last_layers_in_bf16 == 1
    assert first.rollout == RolloutSettings(fp8_backend="triton", token_ids_only=args.vllm_token_ids_only)
    assert first.fp8_kv_cache == Choice(False, "training on cpu: vLLM's FP8 attention needs a Hopper GPU")
    assert first.start_up_lines(args) == ["FP8 KV cache off: training on cpu: vLLM's FP8 attention needs a Hopper GPU"]
