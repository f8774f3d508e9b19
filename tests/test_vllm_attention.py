"""The attention kernel of the engine's FP8 KV cache (`trl_fp8.rollout.vllm.attention`) and trl-fp8's vLLM plugin,
on CPU: the choice and its reasons, the engine arguments that name it, and the plugin's registration against a
stand-in of vLLM's backend registry (the GPU side: tests/gpu/test_xqa_gpu.py)."""

import enum
import importlib.metadata
import os
import sys
import types
from pathlib import Path

import pytest
import tomllib
import torch
from transformers import AutoConfig

from trl_fp8 import FP8GRPOConfig, FP8Tuning
from trl_fp8.rollout.settings import RolloutSettings
from trl_fp8.rollout.vllm import attention
from trl_fp8.rollout.vllm.attention import KVAttention, attention_heads, choose_kv_attention, xqa_env
from trl_fp8.rollout.vllm.engine import engine_overrides

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "trl_fp8.rollout.vllm.plugin:register"


def test_without_a_hopper_gpu_auto_keeps_flash_attention_and_an_explicit_xqa_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    auto = choose_kv_attention("auto")
    assert auto.kernel == "flash_attn" and auto.backend == "FLASH_ATTN" and "no CUDA GPU" in auto.reason
    assert auto.env == {}
    with pytest.raises(ValueError, match="XQA cannot run here: no CUDA GPU.*'flash_attn'"):
        choose_kv_attention("xqa")
    assert choose_kv_attention("flash_attn").kernel == "flash_attn"
    with pytest.raises(ValueError, match="vllm_fp8_kv_attention='fa2'.*one of"):
        choose_kv_attention("fa2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "Hopper (SM90)" in choose_kv_attention("auto").reason


def test_shapes_xqa_cannot_take_are_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for heads in ({"head_dim": 72}, {"head_dim": 512}, {"q_heads": 12, "kv_heads": 8}):
        assert "XQA takes head dims 16-256" in attention.xqa_unavailable_reason(**heads), heads


def test_a_checked_xqa_names_trl_fp8s_backend_in_the_engine_arguments(monkeypatch):
    monkeypatch.setattr(attention, "xqa_unavailable_reason", lambda *a, **k: None)
    choice = choose_kv_attention("auto", head_dim=128, q_heads=32, kv_heads=8)
    assert choice.kernel == "xqa" and choice.backend == "CUSTOM"
    assert choice.env["VLLM_HAS_FLASHINFER_CUBIN"] == "1"  # vLLM runs XQA only when told its kernels are there
    overrides = engine_overrides("/tmp/engine", "fp8", True, kv_attention=choice)
    assert overrides["kv_cache_dtype"] == "fp8" and overrides["attention_backend"] == "CUSTOM"
    fallback = KVAttention("flash_attn", "why")
    assert engine_overrides("/tmp/engine", "fp8", True, kv_attention=fallback)["attention_backend"] == "FLASH_ATTN"
    assert engine_overrides("/tmp/engine", "fp8", True)["attention_backend"] == "FLASH_ATTN"
    assert "kv_cache_dtype" not in engine_overrides("/tmp/engine", "fp8", False, kv_attention=choice)


def test_xqa_env_puts_ninja_on_the_path_once(monkeypatch, tmp_path):
    monkeypatch.setattr(attention, "ninja_dir", lambda: str(tmp_path))
    env = xqa_env({"PATH": "/usr/bin"})
    assert env["PATH"] == f"{tmp_path}{os.pathsep}/usr/bin"
    assert "PATH" not in xqa_env({"PATH": f"/usr/bin{os.pathsep}{tmp_path}"})
    monkeypatch.setattr(attention, "ninja_dir", lambda: None)
    assert xqa_env({"PATH": "/usr/bin"}) == {"VLLM_HAS_FLASHINFER_CUBIN": "1"}


def test_ninja_dir_finds_the_ninja_wheels_executable(monkeypatch, tmp_path):
    monkeypatch.setattr(attention.shutil, "which", lambda name: None)
    (tmp_path / "ninja").write_text("")
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(tmp_path)))
    assert attention.ninja_dir() == str(tmp_path)
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(tmp_path / "missing")))
    assert attention.ninja_dir() is None


def test_attention_heads_of_a_config():
    qwen3 = AutoConfig.for_model(
        "qwen3", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128
    )
    assert attention_heads(qwen3) == {"head_dim": 128, "q_heads": 16, "kv_heads": 8}
    llama = AutoConfig.for_model("llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=None)
    assert attention_heads(llama)["head_dim"] == 128 and attention_heads(llama)["kv_heads"] == 8


def test_the_tuning_option_reaches_the_rollout_settings_and_its_misuses_are_refused(monkeypatch):
    monkeypatch.setattr("trl_fp8.config.check_vllm_version", lambda: "0.31.0")  # a config with use_vllm=True builds
    args = FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, use_vllm=True, fp8_kv_cache=True)
    assert RolloutSettings.from_args(args, FP8Tuning(vllm_fp8_kv_attention="flash_attn")).kv_attention == "flash_attn"
    assert RolloutSettings.from_args(args).kv_attention == "auto"
    with pytest.raises(ValueError, match="vllm_fp8_kv_attention='fa3'\\) is unknown"):
        FP8Tuning(vllm_fp8_kv_attention="fa3")
    no_kv = FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, use_vllm=True, fp8_kv_cache=False)
    with pytest.raises(ValueError, match="but fp8_kv_cache=False"):
        FP8Tuning(vllm_fp8_kv_attention="xqa").check(no_kv)
    planned = FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, use_vllm=True)  # the plan decides
    FP8Tuning(vllm_fp8_kv_attention="xqa").check(planned)
    server = FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, use_vllm=True, fp8_kv_cache=True,
                           vllm_mode="server")  # fmt: skip
    with pytest.raises(ValueError, match="--attention-backend CUSTOM"):
        FP8Tuning(vllm_fp8_kv_attention="xqa").check(server)
    no_vllm = FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="use_vllm=False"):
        FP8Tuning(vllm_fp8_kv_attention="flash_attn").check(no_vllm)


def test_the_package_declares_its_vllm_plugin():
    """vLLM loads `vllm.general_plugins` entry points in each of its processes: the server's finds the backend so."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"trl_fp8": PLUGIN}
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert installed.get("trl_fp8") == PLUGIN  # the installed package's metadata (reinstall after editing pyproject)


@pytest.fixture
def vllm_registry(monkeypatch):
    """A stand-in for vLLM's attention backend registry (`vllm.v1.attention.backends.registry`, 0.26 and 0.31)."""
    overrides = {}

    class AttentionBackendEnum(enum.Enum):
        FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
        CUSTOM = None

        def get_path(self):
            path = overrides.get(self, self.value)
            if not path:
                raise ValueError(f"Backend {self.name} must be registered before use.")
            return path

    def register_backend(backend, class_path=None, is_mamba=False):
        overrides[backend] = class_path
        return lambda cls: cls

    registry = types.ModuleType("vllm.v1.attention.backends.registry")
    registry.AttentionBackendEnum, registry.register_backend = AttentionBackendEnum, register_backend
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, registry.__name__, registry)
    return AttentionBackendEnum


def test_the_plugin_registers_the_backend_as_custom_and_keeps_another_packages(vllm_registry, caplog):
    from trl_fp8.rollout.vllm import plugin
    from trl_fp8.rollout.vllm._compat import LIVE_SCALE_BACKEND

    plugin.register()
    plugin.register()  # vLLM may call it more than once in a process
    assert vllm_registry.CUSTOM.get_path() == LIVE_SCALE_BACKEND
    assert LIVE_SCALE_BACKEND == "trl_fp8.rollout.vllm.xqa_backend.LiveScaleFlashInferBackend"
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(vllm_registry.CUSTOM, "other.package.Backend")
    plugin.register()
    assert vllm_registry.CUSTOM.get_path() == "other.package.Backend"
    assert "already other.package.Backend" in caplog.text


def test_the_plugin_does_nothing_without_vllm(monkeypatch):
    from trl_fp8.rollout.vllm import plugin

    monkeypatch.setitem(sys.modules, "vllm", None)  # import fails
    plugin.register()


def test_the_xqa_check_leaves_the_environment_as_it_found_it(monkeypatch, tmp_path):
    """The check builds XQA with ninja on the PATH and vLLM's XQA setting; the engine gets them only with XQA chosen."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("trl_fp8.rollout.vllm._compat.live_scale_backend_missing", lambda: None)
    monkeypatch.setattr("trl_fp8.rollout.vllm._compat.flashinfer_xqa_decode", lambda: object())
    monkeypatch.setattr(attention, "_find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(attention, "ninja_dir", lambda: str(tmp_path))
    monkeypatch.delenv("VLLM_HAS_FLASHINFER_CUBIN", raising=False)
    path = os.environ.get("PATH")
    seen = {}

    def build_fails(*args, **kwargs):
        seen.update(cubin=os.environ.get("VLLM_HAS_FLASHINFER_CUBIN"), path=os.environ["PATH"])
        raise RuntimeError("nvcc failed\nmore")

    monkeypatch.setattr(attention, "decode_follows_live_scales", build_fails)
    assert attention.xqa_unavailable_reason() == "XQA did not build or run here (RuntimeError: nvcc failed)"
    assert seen == {"cubin": "1", "path": f"{tmp_path}{os.pathsep}{path}"}
    assert "VLLM_HAS_FLASHINFER_CUBIN" not in os.environ and os.environ.get("PATH") == path
