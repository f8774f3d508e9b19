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
    monkeypatch.setattr(engine, "allocator_expandable_segments", lambda: None)  # cannot say: the environment's word
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


# Allocator settings in the environment, and what PyTorch parses from them (read off `torch._C.
# _accelerator_getAllocatorSettings()` on torch 2.13 without a GPU and off the memory snapshot's settings on torch 2.11
# with an H200: the old name first, the current one where the old is unset; set empty, the old one still wins).
ALLOCATOR_ENVIRONMENTS = {
    "neither": ({}, ""),
    "current name only": ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments:True"),
    "current name only, other options": ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}, "max_split_size_mb:512"),
    "current name only, on among others": (
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"},
        "max_split_size_mb:512,expandable_segments:True",
    ),
    "old name only": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments:True"),
    "old name only, other options": ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, "max_split_size_mb:64"),
    "both, on in the current one": (
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},
        "max_split_size_mb:64",
    ),
    "both, on in the old one": (
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
        "expandable_segments:True",
    ),
    "both, the old one empty": ({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}, ""),
}


def test_the_allocator_settings_are_read_in_pytorchs_order():
    """Where both variables are set, what `expandable_segments_on` reads from the environment is what the installed
    PyTorch parses from it (asked in a process of its own per environment: PyTorch reads the variables once)."""
    import os
    import subprocess
    import sys

    from trl_fp8.rollout.vllm import engine

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this PyTorch (before 2.13) says which settings it parsed only through a GPU's memory snapshot")
    base = {k: v for k, v in os.environ.items() if not k.endswith("_ALLOC_CONF")}
    ask = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
    children = {
        name: subprocess.Popen([sys.executable, "-c", ask], env={**base, **environ}, stdout=subprocess.PIPE, text=True)
        for name, (environ, _) in ALLOCATOR_ENVIRONMENTS.items()
        if len(environ) == 2
    }
    for name, child in children.items():
        environ, parsed = ALLOCATOR_ENVIRONMENTS[name]
        assert child.communicate(timeout=120)[0].strip() == parsed, name  # the table above holds for this PyTorch
        assert engine.expandable_segments_on(environ) == ("expandable_segments:True" in parsed), name


class FakeAllocator:
    """PyTorch's CUDA caching allocator as `torch.cuda.memory._snapshot` reports it, on the CPU: settings parsed
    once from the environment (given: `parsed`), then changed at run time by the settings setter, which leaves
    expandable segments as they were where the new settings do not name them (seen on torch 2.11 with an H200)."""

    def __init__(self, parsed: str):
        self.settings, self.expandable = "", False
        self.apply(parsed)

    def apply(self, settings: str) -> None:
        self.settings = settings
        for item in settings.split(","):
            key, _, value = item.replace(" ", "").partition(":")
            if key == "expandable_segments":
                self.expandable = value == "True"

    def snapshot(self):
        return {"segments": [], "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": self.settings,
                                                       "expandable_segments": self.expandable}}  # fmt: skip


def _sleeping_run(monkeypatch, parsed: str) -> FakeAllocator:
    from trl_fp8.rollout.vllm import engine

    allocator = FakeAllocator(parsed)
    monkeypatch.setattr(engine, "set_allocator_settings", allocator.apply)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", allocator.snapshot)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return allocator


@pytest.mark.parametrize("name", list(ALLOCATOR_ENVIRONMENTS))
def test_sleep_mode_records_expandable_segments_where_they_are_read(monkeypatch, name):
    """Whichever variable the user set: after the trainer's sleep-mode set-up the allocator runs on expandable
    segments, the user's other options kept; the environment says so as PyTorch reads it (a child process) and as
    vLLM reads it (PYTORCH_CUDA_ALLOC_CONF, spelt as vLLM looks for it, to turn them off around its sleep-mode pool);
    and a tensor-parallel engine leaves vLLM's custom all-reduce off."""
    from types import SimpleNamespace

    from trl_fp8.rollout.vllm import engine
    from trl_fp8.rollout.vllm.partitions import tensor_parallel_overrides

    environ, parsed = dict(ALLOCATOR_ENVIRONMENTS[name][0]), ALLOCATOR_ENVIRONMENTS[name][1]
    allocator = _sleeping_run(monkeypatch, parsed)
    sleeping = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    engine.sleep_mode_allocator(sleeping, environ)
    assert allocator.expandable
    assert engine.expandable_segments_on(environ)  # the record, read as PyTorch reads it
    assert engine.EXPANDABLE_SEGMENTS in environ["PYTORCH_CUDA_ALLOC_CONF"]  # as vLLM reads it
    assert engine.expandable_segments_on()  # the allocator, asked
    others = [item for item in parsed.split(",") if item and not item.startswith("expandable_segments")]
    assert all(item in allocator.settings.split(",") for item in others)  # the user's other options stay
    assert tensor_parallel_overrides(2, environ)["disable_custom_all_reduce"][0] is True
    assert engine.sleep_mode_allocator(sleeping, environ) is None  # set: nothing more to do


@pytest.mark.parametrize(
    "environ",
    [{"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
     {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_ALLOC_CONF": "expandable_segments: False"},
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}],
)  # fmt: skip
def test_sleep_mode_keeps_a_users_explicit_false_in_either_variable(monkeypatch, environ):
    """An explicit `expandable_segments:False` is the user's choice, in whichever variable: kept with a warning
    naming that variable, and everything that reads the setting agrees that they are off."""
    from types import SimpleNamespace

    from trl_fp8.rollout.vllm import engine
    from trl_fp8.rollout.vllm.partitions import tensor_parallel_overrides

    said = "PYTORCH_CUDA_ALLOC_CONF" if "False" in environ.get("PYTORCH_CUDA_ALLOC_CONF", "") else "PYTORCH_ALLOC_CONF"
    allocator = _sleeping_run(monkeypatch, environ.get("PYTORCH_CUDA_ALLOC_CONF", environ["PYTORCH_ALLOC_CONF"]))
    sleeping = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    before = dict(environ)
    level, line = engine.sleep_mode_allocator(sleeping, environ)
    assert level == logging.WARNING and f"{said}=expandable_segments:False" in line, line
    assert environ == before and not allocator.expandable
    assert not engine.expandable_segments_on(environ) and not engine.expandable_segments_on()
    assert "disable_custom_all_reduce" not in tensor_parallel_overrides(2, environ)
