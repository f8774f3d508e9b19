"""FP8RLOOTrainer on a tiny Qwen3 (CPU, exact FP8 emulation): the same precision flow, conversion, start-up checks and
block-FP8 export as FP8GRPOTrainer, on TRL's RLOOTrainer."""

import json

import pytest
import torch
from safetensors import safe_open

from trl_fp8 import FP8GRPOConfig, FP8Linear, FP8RLOOConfig, FP8RLOOTrainer
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
from trl_fp8.trainer.model_card import fp8_model_card_section


def rloo_args(tmp_path, **kw):
    settings = dict(GRPO_SETTINGS, output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=16,
                    logging_steps=1, use_cpu=True, bf16=False, disable_tqdm=True)  # fmt: skip
    return FP8RLOOConfig(**{**settings, **kw})


def test_rloo_trains_in_fp8_and_saves_a_block_fp8_checkpoint(model_dir, tmp_path):
    trainer = FP8RLOOTrainer(model_dir, say_letter_reward, rloo_args(tmp_path), train_dataset=say_letter_dataset(64))
    fp8_layers = [m for m in trainer.model.modules() if isinstance(m, FP8Linear)]
    assert len(fp8_layers) == trainer.fp8_report.num_fp8_layers == 28
    before = fp8_layers[0].weight.detach().clone()
    trainer.train()
    assert not fp8_layers[0].weight.detach().equal(before)  # the FP8 layers trained
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert logs and all(log["fp8/num_fp8_layers"] == 28 for log in logs)
    out = tmp_path / "fp8"
    trainer.save_model(str(out))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    with safe_open(out / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv")
    layer = trainer.model.model.layers[0].self_attn.q_proj
    ours_q, ours_s = layer.quantized_weight()
    # the trained weights the forward used, bit for bit
    assert q.view(torch.uint8).equal(ours_q.view(torch.uint8)) and s.equal(ours_s)
    card = fp8_model_card_section(trainer.fp8_report, trainer.args, trainer_name=type(trainer).__name__)
    assert "recipe `blockwise` (28 linear layers in FP8)" in card and "TIS" not in card
    assert "Trained with trl-fp8's `FP8RLOOTrainer`" in card and "GRPO" not in card and "http" not in card


def test_rloo_refuses_what_it_cannot_do(model_dir, tmp_path):
    with pytest.raises(TypeError, match="FP8RLOOTrainer needs an FP8RLOOConfig, got FP8GRPOConfig"):
        FP8RLOOTrainer(model_dir, say_letter_reward, FP8GRPOConfig(str(tmp_path), use_cpu=True, bf16=False))
    with pytest.raises(ValueError, match=r"input model's own folder.*another output_dir \(FP8RLOOConfig\(output_dir"):
        FP8RLOOTrainer(model_dir, say_letter_reward, rloo_args(tmp_path, output_dir=model_dir))
    with pytest.raises(TypeError, match="unexpected keyword argument 'tis'"):
        rloo_args(tmp_path, tis="token")  # RLOO has no rollout correction: the option does not exist
    with pytest.raises(ValueError, match="fp8_kv_cache sets vLLM's KV cache dtype; it needs use_vllm=True"):
        rloo_args(tmp_path, fp8_kv_cache=True)


def test_rloo_scores_without_gradients_logprob_batch_size_sequences_at_a_time(model_dir, tmp_path, monkeypatch):
    """`logprob_batch_size` (shared with FP8GRPOConfig): RLOO's old log-probs go through TRL's scoring loop that many
    sequences at a time; its training forward keeps TRL's."""
    from trl import RLOOTrainer

    calls = []
    trl_scoring = RLOOTrainer._get_per_token_logps_and_entropies

    def recorded(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, *args, **kwargs):
        calls.append((torch.is_grad_enabled(), batch_size))
        return trl_scoring(self, model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs)

    monkeypatch.setattr(RLOOTrainer, "_get_per_token_logps_and_entropies", recorded)
    args = rloo_args(tmp_path, max_steps=1, logprob_batch_size=4)
    FP8RLOOTrainer(model_dir, say_letter_reward, args, train_dataset=say_letter_dataset(64)).train()
    assert {batch for grad, batch in calls if not grad} == {4}
    assert calls and all(batch != 4 for grad, batch in calls if grad)
