"""What the trainer hands vLLM (`trl_fp8.rollout.vllm.engine`): the tensors a sync pushes (which names, which dtypes,
which bits; PEFT adapters merged first; the attention scales last), the engine's start-up folder, and the allocator
advice for sleep mode. On CPU without vLLM (`fake_vllm` stands in for its `LLM`)."""

import json
import logging

import pytest
import torch

from trl_fp8 import FP8Linear
from trl_fp8.checkpoint.save import fp8_module_names
from trl_fp8.demo.tiny_model import tiny_char_tokenizer
from trl_fp8.rollout.kv_scales import AttentionScaleObserver
from trl_fp8.rollout.vllm.engine import rollout_weight_tensors, write_engine_config

from conftest import assert_fp8_equal
from fake_vllm import fp8_model, tiny_trainer


def scale_names(model):
    return {f"{n}.weight_scale_inv" for n in fp8_module_names(model)}


def test_fp8_rollout_pushes_the_trainers_own_fp8_bits_and_bf16_for_the_rest():
    model = fp8_model()
    pairs = dict(rollout_weight_tensors(model, "fp8", fp8_modules=fp8_module_names(model)))
    assert set(pairs) == set(model.state_dict()) | scale_names(model)
    fp8_layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert len(fp8_layers) == 4 * 7  # q k v o gate up down in every decoder layer; lm_head stays high precision
    for name, module in fp8_layers.items():
        weight, scale = pairs[f"{name}.weight"], pairs[f"{name}.weight_scale_inv"]
        assert weight.shape == module.weight.shape
        assert scale.shape == (module.out_features // 128, module.in_features // 128)
        assert_fp8_equal(weight, scale, module.weight)
    others = {n: t for n, t in pairs.items() if not n.endswith("_scale_inv") and t.dtype != torch.float8_e4m3fn}
    assert "lm_head.weight" in others and "model.embed_tokens.weight" in others and "model.norm.weight" in others
    assert all(t.dtype == torch.bfloat16 for t in others.values())
    assert torch.equal(others["model.norm.weight"], model.model.norm.weight.to(torch.bfloat16))


@pytest.mark.parametrize("precision", ["bf16", "fp8_online"])
def test_high_precision_rollouts_push_bf16_master_weights_under_the_same_names(precision):
    model = fp8_model()
    pairs = dict(rollout_weight_tensors(model, precision, fp8_modules=fp8_module_names(model)))
    assert set(pairs) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert pairs[name].dtype == torch.bfloat16 and torch.equal(pairs[name], tensor.to(torch.bfloat16)), name


def test_tied_lm_head_is_left_to_vllm():
    model = fp8_model(tie_word_embeddings=True)
    names = [n for n, _ in rollout_weight_tensors(model, "fp8", fp8_modules=fp8_module_names(model))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_lora_is_merged_before_quantization_and_names_are_plain():
    from peft import LoraConfig, get_peft_model

    base = fp8_model()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    fp8_modules = fp8_module_names(model)
    pairs = dict(rollout_weight_tensors(model, "fp8", fp8_modules=fp8_modules))
    assert not any("lora" in n or "base_layer" in n or "base_model" in n for n in pairs)
    lora_q = model.base_model.model.model.layers[0].self_attn.q_proj
    merged = lora_q.base_layer.weight.detach() + lora_q.get_delta_weight("default")
    pushed = pairs["model.layers.0.self_attn.q_proj.weight"], pairs["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert_fp8_equal(*pushed, merged)
    bf16 = dict(rollout_weight_tensors(model, "bf16", fp8_modules=fp8_modules))
    assert torch.equal(bf16["model.layers.0.self_attn.q_proj.weight"], merged.to(torch.bfloat16))
    assert set(bf16) == {n.replace(".base_layer", "") for n in base.state_dict() if "lora" not in n}


def test_attention_scales_come_last_as_float32_scalars():
    model = fp8_model()
    observer = AttentionScaleObserver(model)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8)))
    pairs = list(
        rollout_weight_tensors(model, "fp8", fp8_modules=fp8_module_names(model), attention_scales=observer.scales())
    )
    tail = pairs[-12:]
    assert all(
        n.endswith(("q_scale", "k_scale", "v_scale")) and t.shape == () and t.dtype == torch.float32 for n, t in tail
    )
    assert not any(n.endswith(("q_scale", "k_scale", "v_scale")) for n, _ in pairs[:-12])


def test_engine_folder_has_configs_and_tokenizer_but_no_weights(tmp_path):
    model, tokenizer = fp8_model(vocab_size=128), tiny_char_tokenizer()
    write_engine_config(model, tokenizer, tmp_path / "fp8", fp8_module_names(model))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert quant["modules_to_not_convert"] == ["lm_head"] and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["dtype"] == "bfloat16" and (tmp_path / "fp8" / "tokenizer_config.json").exists()
    assert not list((tmp_path / "fp8").glob("*.safetensors"))
    write_engine_config(model, None, tmp_path / "bf16", set())
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())


def test_sleep_mode_turns_on_expandable_segments_where_the_user_left_them_unset(monkeypatch):
    """PyTorch's allocator otherwise keeps freed training memory pinned while vLLM wakes into its share: the trainer
    turns expandable segments on, in the allocator and in PYTORCH_CUDA_ALLOC_CONF (which vLLM reads to turn them off
    around its own pool), and says so; an explicit False is kept with a warning; set (any spelling), without sleep
    mode, or without a GPU, nothing happens."""
    from types import SimpleNamespace

    from trl_fp8.rollout.vllm import engine

    calls = []
    monkeypatch.setattr(engine, "set_allocator_settings", calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    sleeping = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    level, line = engine.sleep_mode_allocator(sleeping, environ)
    assert level == logging.INFO and "turned on PyTorch's expandable segments" in line
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    assert calls == ["max_split_size_mb:512,expandable_segments:True"]  # the setter resets what it is not given
    assert engine.sleep_mode_allocator(sleeping, environ) is None  # already on: once
    level, line = engine.sleep_mode_allocator(sleeping, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments: False"})
    assert level == logging.WARNING and "lower vllm_gpu_memory_utilization" in line
    # PyTorch's newer PYTORCH_ALLOC_CONF wins over PYTORCH_CUDA_ALLOC_CONF, as PyTorch reads them
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    level, line = engine.sleep_mode_allocator(sleeping, both)
    assert level == logging.WARNING and "lower vllm_gpu_memory_utilization" in line
    awake = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False)
    assert engine.sleep_mode_allocator(awake, {}) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine.sleep_mode_allocator(sleeping, {}) is None and len(calls) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def cannot(settings):
        raise RuntimeError("not at run time")

    monkeypatch.setattr(engine, "set_allocator_settings", cannot)
    environ = {}
    level, line = engine.sleep_mode_allocator(sleeping, environ)
    assert level == logging.WARNING and "before the run starts" in line and environ == {}  # no half-set setting


def test_the_trainer_logs_what_the_allocator_check_says(fake_vllm, tmp_path, caplog, monkeypatch):
    from trl_fp8.rollout.vllm import engine

    monkeypatch.setattr(engine, "sleep_mode_allocator", lambda args: (logging.INFO, "allocator: said once"))
    with caplog.at_level(logging.INFO):
        tiny_trainer(tmp_path / "a", vllm_enable_sleep_mode=True)
    assert [r.getMessage() for r in caplog.records].count("allocator: said once") == 1


def test_the_engine_gets_the_moe_kernel_and_a_model_without_fp8_experts_is_refused(fake_vllm, tmp_path):
    from test_fp8_experts import tiny_moe

    tiny_trainer(tmp_path / "moe", model=tiny_moe(), vllm_fp8_moe_backend="triton")
    assert fake_vllm.instances[-1].kwargs["moe_backend"] == "triton"
    with pytest.raises(ValueError, match="has no FP8 experts layer .*Drop vllm_fp8_moe_backend"):
        tiny_trainer(tmp_path / "dense", vllm_fp8_moe_backend="triton")
