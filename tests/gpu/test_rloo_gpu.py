"""FP8RLOOTrainer with vLLM colocated on one SM90 GPU: its rollouts run the trainer's own FP8 weights and scales."""

import json

import pytest

pytestmark = pytest.mark.gpu


def test_rloo_colocate_rollouts_use_the_trainers_fp8_weights(tmp_path):
    pytest.importorskip("vllm")
    from test_trainer_gpu import assert_learned
    from test_vllm_gpu import assert_engine_holds_trainer_fp8, save_warm_model

    from trl_fp8 import FP8RLOOConfig, FP8RLOOTrainer
    from trl_fp8.demo.toy_task import DEMO_GRPO_SETTINGS, say_letter_dataset, say_letter_reward

    before = save_warm_model(tmp_path / "model")
    args = FP8RLOOConfig(
        **DEMO_GRPO_SETTINGS, output_dir=str(tmp_path / "out"), max_steps=20, logging_steps=1, bf16=True,
        disable_tqdm=True, model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25,
    )  # fmt: skip
    assert args.rollout_precision == "fp8"
    trainer = FP8RLOOTrainer(str(tmp_path / "model"), say_letter_reward, args, train_dataset=say_letter_dataset(2048))
    trainer.train()
    assert_engine_holds_trainer_fp8(trainer)  # after training: the engine holds the trained FP8 bits and scales
    assert_learned(trainer, before, "RLOO colocate fp8")
    out = tmp_path / "fp8"
    trainer.save_model(str(out))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
