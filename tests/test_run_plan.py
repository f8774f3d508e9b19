"""`FP8RunPlan`: the run's decisions made once, read by the trainer, never written into the user's args."""

import copy
import dataclasses

import pytest

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8RLOOConfig
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
    lines = first.start_up_lines(args)
    assert lines[0] == "FP8 KV cache off: training on cpu: vLLM's FP8 attention needs a Hopper GPU"
    assert [line.split(":")[0] for line in lines[1:]] == ["token-level truncated importance sampling on",
                                                          "scoring the rollouts in the training forward on"]  # fmt: skip


def test_the_trainers_copy_keeps_the_names_transformers_shares_for_one_object(tmp_path):
    """transformers keeps two names for one dict (`gradient_checkpointing_kwargs`, the deprecated alias of
    `activation_checkpointing_kwargs`) and DeepSpeed's config under two (`hf_deepspeed_config` and
    `deepspeed_plugin.hf_ds_config`): in the trainer's copy each pair is still one object (what TRL or transformers
    writes through one name, the other reads), and not the user's."""
    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_checkpointing=True,
                         activation_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    assert args.gradient_checkpointing_kwargs is args.activation_checkpointing_kwargs  # transformers' own aliasing
    resolved = FP8RunPlan.build(args, tiny_qwen3_config()).trainer_args(args)
    assert resolved.gradient_checkpointing_kwargs is resolved.activation_checkpointing_kwargs
    resolved.activation_checkpointing_kwargs["use_reentrant"] = True  # as TRL sets it in its copy
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}

    pytest.importorskip("deepspeed")
    stage2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto"}  # fmt: skip
    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, deepspeed=stage2)
    assert args.deepspeed_plugin.hf_ds_config is args.hf_deepspeed_config
    resolved = FP8RunPlan.build(args, tiny_qwen3_config()).trainer_args(args)
    assert resolved.deepspeed_plugin.hf_ds_config is resolved.hf_deepspeed_config
    assert resolved.deepspeed_plugin.deepspeed_config is resolved.hf_deepspeed_config.config
    assert resolved.hf_deepspeed_config is not args.hf_deepspeed_config
    resolved.hf_deepspeed_config.config["gradient_accumulation_steps"] = 4  # as transformers fills in "auto"
    assert args.hf_deepspeed_config.config["gradient_accumulation_steps"] == 1


def test_the_plan_decides_tis_and_where_the_rollouts_are_scored(fake_vllm, tmp_path):
    """Token TIS (whether it corrects anything, who applies it, its cap) and scoring in the training forward are the
    plan's decisions, with their reasons, from the settings alone; RLOO's config has neither."""
    from trl_fp8.plan import TokenTIS

    config = tiny_qwen3_config()

    def plan(rollout_func=False, **settings):
        args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **settings)
        return FP8RunPlan.build(args, config, rollout_func=rollout_func), args

    own, args = plan()  # the default tis="auto", and the policy samples its own rollouts: nothing to correct
    assert own.token_tis == Choice(None, "the policy samples its own rollouts (use_vllm=False, no rollout_func): "
                                   "nothing to correct", automatic=False)  # fmt: skip
    assert not own.scoring_in_training_forward.on and own.start_up_lines(args) == []
    elsewhere, _ = plan(rollout_func=True, tis_cap=3.0)  # the trainer applies it to a rollout_func's rollouts
    assert elsewhere.token_tis.value == TokenTIS(3.0, by_trainer=True) and elsewhere.token_tis.automatic
    assert elsewhere.scoring_in_training_forward.on and elsewhere.scoring_in_training_forward.automatic
    vllm, _ = plan(use_vllm=True, vllm_mode="colocate")  # TRL's loss code applies it
    assert vllm.token_tis.value == TokenTIS(2.0, by_trainer=False)
    theirs, _ = plan(use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_mode="sequence_truncate")
    assert theirs.token_tis == Choice(None, "TRL's importance sampling as set "
                                            "(vllm_importance_sampling_mode='sequence_truncate')")  # fmt: skip
    off, _ = plan(use_vllm=True, vllm_mode="colocate", tis="off", score_in_training_forward=False)
    assert off.token_tis == Choice(None, "set by tis='off'", automatic=False)
    assert off.scoring_in_training_forward == Choice(False, "set by score_in_training_forward", automatic=False)
    rloo = FP8RunPlan.build(FP8RLOOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False), config)
    assert rloo.token_tis is None and rloo.scoring_in_training_forward is None


def _qwen3_8b_config():
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)  # fmt: skip


@pytest.mark.parametrize("generation_batch", [16, 256])  # a rollout the BF16 KV cache holds, and one it does not
def test_trl_fp8_plan_says_the_choices_the_trainers_plan_makes(fake_vllm, tmp_path, capsys, generation_batch):
    """For the same model and settings on the same GPU (H100, Hopper), `trl-fp8 plan` reports the trainer's own
    choices: the FP8 KV cache with its reason (one code path, `plan.choices.choose_fp8_kv_cache`) and whether the
    FP8 weight cache stays. The trainer counts the completions alone: the planner is given no prompt tokens here."""
    from trl_fp8.cli.main import main as cli
    from trl_fp8.plan.choices import HOPPER
    from trl_fp8.rollout.capacity import GPU_MEMORY_BYTES

    config = _qwen3_8b_config()
    config.save_pretrained(tmp_path / "model")
    assert cli(["plan", str(tmp_path / "model"), "--gpu", "H100", "--prompt_len", "0", "--completion_len", "2048",
                "--generation_batch", str(generation_batch), "--micro_batch", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    args = FP8GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, use_vllm=True,
                         vllm_mode="colocate", max_completion_length=2048, generation_batch_size=generation_batch,
                         per_device_train_batch_size=8, num_generations=8, vllm_gpu_memory_utilization=0.3,
                         gradient_checkpointing=True, optim="adamw_torch")  # fmt: skip
    plan = FP8RunPlan.build(args, config, total_bytes=GPU_MEMORY_BYTES["H100"], capability=HOPPER)
    kv = plan.fp8_kv_cache
    assert kv.automatic and kv.on is (generation_batch == 256)
    assert f"KV cache with fp8_kv_cache unset: {'FP8' if kv.on else 'BF16'} on Hopper, {kv.reason}." in out
    assert ("FP8: without the FP8 weight cache" in out or "FP8 and FP8 + FP8 KV: without" in out) is not (
        plan.fp8_weight_cache.value.cache
    )


def test_the_benchmark_records_a_choice_under_the_keys_its_results_use():
    """bench_grpo's rows keep the keys of the results recorded before the plan (`on`, `cache` + `with_grad`,
    `sync_each_batch`), so old and new rows read alike."""
    from benchmarks.bench_grpo import choice_record

    assert choice_record(Choice(True, "why"), "on") == {"on": True, "reason": "why", "automatic": True}
    cache = choice_record(Choice(WeightCache(False), "why", automatic=False), "cache")
    assert cache == {"cache": False, "reason": "why", "automatic": False, "with_grad": None}
    assert choice_record(None, "sync_each_batch") is None
