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
    # the plugin names trl-fp8's MoE tiles in this variable: restored after
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
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
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    plugin.register()


def test_the_xqa_check_leaves_the_environment_as_it_found_it(monkeypatch, tmp_path):
    """The check builds XQA with ninja on the PATH and vLLM's XQA setting; the engine gets them only with XQA chosen."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("trl_fp8.rollout.vllm._compat.live_scale_backend_missing", lambda: None)
    monkeypatch.setattr("trl_fp8.rollout.vllm._compat.flashinfer_xqa_decode", lambda: object())
    monkeypatch.setattr("trl_fp8.rollout.vllm._compat.flashinfer_xqa_kernel_missing", lambda: None)
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


# --- XQA's precomputed scales: the refresh, the marker, the direct call (`xqa_scales`, `_compat`, `xqa_backend`) ----

SEMAPHORE_BYTES = 8 * 1024 * 1024


@pytest.fixture
def fake_xqa(monkeypatch):
    """A stand-in for `flashinfer.xqa.xqa` (FlashInfer 0.6.14's signature; 0.7 adds keyword-only `q_cu_seq_lens`)
    recording each call's arguments by name, and for the two `flashinfer.utils` helpers the direct call asks."""
    calls = []

    def xqa(q, k_cache, v_cache, page_table, seq_lens, output, workspace_buffer, semaphores, num_kv_heads, page_size,
            sinks=None, q_scale=1.0, kv_scale=1.0, sliding_win_size=0, kv_layout="NHD", sm_count=None,
            enable_pdl=None, rcp_out_scale=1.0, q_seq_len=1, mask=None, *, k_sf_cache=None,
            v_sf_cache=None):  # fmt: skip
        calls.append(dict(locals()))

    modules = {name: types.ModuleType(name) for name in ("flashinfer", "flashinfer.xqa", "flashinfer.utils")}
    modules["flashinfer.xqa"].xqa = xqa
    modules["flashinfer.utils"].get_device_sm_count = lambda device: 132
    modules["flashinfer.utils"].device_support_pdl = lambda device: "pdl as FlashInfer decides"
    modules["flashinfer"].xqa, modules["flashinfer"].utils = modules["flashinfer.xqa"], modules["flashinfer.utils"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _scale_layer(k_scale=0.004, v_scale=0.006):
    layer = torch.nn.Module()  # vLLM's attention layer holds its scales as 0-dim float32 tensors
    layer._k_scale, layer._v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
    return layer


def _decode_inputs(layout="NHD", seqs=3, q_heads=8, kv_heads=2, head_dim=64, page_size=16, pages=7):
    cache_shape = (pages, page_size, kv_heads, head_dim) if layout == "NHD" else (pages, kv_heads, page_size, head_dim)
    packed = torch.zeros(*cache_shape[:-1], 2 * head_dim, dtype=torch.uint8)  # vLLM's K and V side by side
    return {
        "query": torch.randn(seqs, q_heads, head_dim).to(torch.bfloat16),
        "kv_cache": tuple(packed.split(head_dim, dim=-1)),
        "workspace_buffer": torch.zeros(SEMAPHORE_BYTES + 4096, dtype=torch.uint8),
        "block_tables": torch.arange(seqs * 2, dtype=torch.int32).view(seqs, 2),
        "seq_lens": torch.tensor([17, 5, 30], dtype=torch.int32),
        "max_seq_len": 32,
        "out": torch.empty(seqs, q_heads, head_dim, dtype=torch.bfloat16),
    }


def test_refresh_precomputes_xqas_q_scale_in_place_and_keeps_the_layers_v_scale():
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    layer, head_dim = _scale_layer(0.004, 0.006), 128
    live = LiveXQAScales(head_dim**-0.5, head_dim)
    assert live.scales is None and live.refresh() is False  # no layer seen yet
    assert live.refresh(layer) is True
    scales = live.scales
    # XQA multiplies Q.K by q_scale * kv_scale / sqrt(head_dim): sm_scale * k_scale, as vLLM's bmm1_scale
    assert scales.q_scale.dtype == torch.float32 and scales.q_scale.shape == ()
    assert scales.q_scale.item() == pytest.approx(0.004 / 0.006, rel=1e-6)  # sm_scale * sqrt(d) = 1
    assert scales.kv_scale is layer._v_scale and scales.k_scale is layer._k_scale  # no copy, no arithmetic
    assert (scales.q_scale * scales.kv_scale / head_dim**0.5).item() == pytest.approx(head_dim**-0.5 * 0.004)
    assert scales.bmm1_scale().item() == pytest.approx(head_dim**-0.5 * 0.004)  # for FlashInfer's own wrapper
    storage = scales.q_scale.data_ptr()
    layer._k_scale.fill_(0.01)
    layer._v_scale.fill_(0.002)
    assert live.refresh() is True  # through the weak reference, as after a reload
    assert live.scales is scales and scales.q_scale.data_ptr() == storage  # what captured graphs read, rewritten
    assert scales.q_scale.item() == pytest.approx(5.0, rel=1e-6)
    other = _scale_layer(0.003, 0.001)  # new tensor objects: a new marker around the same q_scale storage
    live.refresh(other)
    assert live.scales.kv_scale is other._v_scale and live.scales.q_scale.data_ptr() == storage
    assert live.scales.q_scale.item() == pytest.approx(3.0, rel=1e-6)
    live64 = LiveXQAScales(0.1, 64)  # any sm_scale: q_scale = sm_scale * sqrt(d) * k / v
    live64.refresh(layer)
    assert live64.scales.q_scale.item() == pytest.approx(0.1 * 8 * 0.01 / 0.002, rel=1e-6)
    del other
    import gc

    gc.collect()
    assert live.refresh() is False  # the layer is gone: nothing to read


def test_no_refresh_while_a_cuda_graph_is_captured(monkeypatch):
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    layer = _scale_layer(0.004, 0.004)
    live = LiveXQAScales(1.0, 1)
    live.refresh(layer)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    layer._k_scale.fill_(0.008)
    assert live.refresh(layer) is False and live.refresh() is False
    assert live.scales.q_scale.item() == 1.0  # the graph reads the tensor; recomputing it would be captured
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert live.refresh() is True and live.scales.q_scale.item() == 2.0


def test_a_reload_outside_inference_mode_refreshes_scales_first_made_in_a_forward():
    """vLLM's forwards (where the scales are first made) run in inference mode, its layerwise reload (which then
    refreshes them) outside it: the refresh must still update the tensor captured graphs read, in place."""
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    with torch.inference_mode():  # the engine's forwards: the layer's scales and q_scale are inference tensors
        layer = _scale_layer(0.004, 0.004)
        live = LiveXQAScales(1.0, 1)
        live.refresh(layer)
    storage = live.scales.q_scale.data_ptr()
    with torch.inference_mode():  # the reload writes the layer's new scales (vLLM's own code)
        layer._k_scale.fill_(0.012)
    assert live.refresh() is True  # outside inference mode, as `process_weights_after_loading` runs it
    assert live.scales.q_scale.data_ptr() == storage and live.scales.q_scale.item() == pytest.approx(3.0, rel=1e-6)
    with torch.inference_mode():  # and the next eager forward
        assert live.refresh(layer) is True


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_direct_call_hands_xqa_what_flashinfers_wrapper_would_and_the_precomputed_tensors(fake_xqa, layout):
    """`xqa_decode_with_scales` reproduces `xqa_batch_decode_with_kv_cache` for one query token per sequence
    (FlashInfer 0.6.14 and 0.7): the layout's page size and KV heads, the workspace split into 8 MiB of semaphores
    and the scratch, the query, lengths and output given a beam dimension, the sinks per KV head, the window, the SM
    count and PDL as FlashInfer decides them; XQA's q_scale and kv_scale are the precomputed tensors themselves."""
    from trl_fp8.rollout.vllm._compat import route_xqa_scales
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    layer = _scale_layer()
    live = LiveXQAScales(64**-0.5, 64)
    live.refresh(layer)
    inputs = _decode_inputs(layout)
    sinks = torch.randn(8)
    original = []
    decode = route_xqa_scales(lambda *a, **k: original.append(k), kv_layout="NHD")
    returned = decode(**inputs, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, window_left=31, sinks=sinks,
                      kv_layout=layout, q_len_per_req=1, mask=None, q_cu_seq_lens=None)  # fmt: skip
    assert original == [] and len(fake_xqa) == 1
    call = fake_xqa[0]
    assert returned is inputs["out"]
    q, out, workspace = inputs["query"], inputs["out"], inputs["workspace_buffer"]
    assert call["q"].shape == (3, 1, 8, 64) and call["q"].data_ptr() == q.data_ptr()
    assert call["output"].shape == (3, 1, 8, 64) and call["output"].data_ptr() == out.data_ptr()
    assert call["seq_lens"].shape == (3, 1) and call["seq_lens"].data_ptr() == inputs["seq_lens"].data_ptr()
    assert call["k_cache"] is inputs["kv_cache"][0] and call["v_cache"] is inputs["kv_cache"][1]
    assert call["page_table"] is inputs["block_tables"]
    assert (call["page_size"], call["num_kv_heads"], call["kv_layout"]) == (16, 2, layout)
    semaphores, scratch = call["semaphores"], call["workspace_buffer"]
    assert semaphores.data_ptr() == workspace.data_ptr() and semaphores.numel() == SEMAPHORE_BYTES
    assert scratch.data_ptr() == workspace.data_ptr() + SEMAPHORE_BYTES and scratch.numel() == 4096
    assert call["sinks"].shape == (2, 4) and call["sinks"].data_ptr() == sinks.data_ptr()
    assert call["q_scale"] is live.scales.q_scale and call["kv_scale"] is layer._v_scale
    assert call["sliding_win_size"] == 32 and call["sm_count"] == 132
    assert call["enable_pdl"] == "pdl as FlashInfer decides" and call["rcp_out_scale"] == 1.0
    assert call["q_seq_len"] == 1 and call["mask"] is None and call["k_sf_cache"] is None
    decode(**inputs, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, enable_pdl=False)  # FlashInfer's defaults
    call = fake_xqa[1]
    assert call["enable_pdl"] is False and call["sliding_win_size"] == 0 and call["sinks"] is None
    assert call["kv_layout"] == "NHD" and call["page_size"] == (16 if layout == "NHD" else 2)


def test_only_the_marker_takes_the_direct_path_and_anything_else_reaches_flashinfer_with_fused_scales(fake_xqa):
    from trl_fp8.rollout.vllm._compat import route_xqa_scales
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    layer = _scale_layer(0.004, 0.006)
    live = LiveXQAScales(64**-0.5, 64)
    live.refresh(layer)
    inputs = _decode_inputs()
    seen = []

    def flashinfer_wrapper(*args, **kwargs):
        seen.append((args, kwargs))
        return "flashinfer"

    decode = route_xqa_scales(flashinfer_wrapper)
    assert decode(**inputs, bmm1_scale=0.5, bmm2_scale=0.006) == "flashinfer"  # vLLM's own backend: floats
    assert seen[-1][1]["bmm1_scale"] == 0.5 and seen[-1][1]["bmm2_scale"] == 0.006
    leading = list(inputs.values())[:6]  # query ... max_seq_len
    decode(*leading, out=inputs["out"])  # positionally, no scales: FlashInfer's own defaults, untouched
    assert "bmm1_scale" not in seen[-1][1] and seen[-1][1]["query"] is inputs["query"]
    mask = torch.ones(3, 2, 2, dtype=torch.uint16)
    others = ({"q_len_per_req": 2, "mask": mask}, {"q_len_per_req": None}, {"o_scale": 0.5},
              {"q_cu_seq_lens": torch.arange(4)}, {"kv_cache_sf": (mask, mask)}, {"some_new_argument": 1})  # fmt: skip
    for other in others:
        decode(**inputs, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, **other)
        kwargs = seen[-1][1]
        assert isinstance(kwargs["bmm1_scale"], torch.Tensor), other  # the fused value, computed from the tensors
        assert (
            kwargs["bmm1_scale"].item() == pytest.approx(64**-0.5 * 0.004) and kwargs["bmm2_scale"] is layer._v_scale
        )
        assert all(kwargs[name] is value for name, value in other.items())
    decode(**inputs, bmm1_scale=live.scales, bmm2_scale=layer._v_scale / 2)  # an output scale folded into bmm2
    assert seen[-1][1]["bmm2_scale"] is not layer._v_scale and not fake_xqa
    assert len(seen) == 9
    decode(*leading, live.scales, layer._v_scale, -1, inputs["out"])  # the marker given positionally
    assert len(seen) == 9 and len(fake_xqa) == 1


def test_vllm_026s_route_goes_direct_only_for_backend_xqa(fake_xqa):
    """vLLM 0.26 calls `trtllm_batch_decode_with_kv_cache(..., backend="xqa")` (HND by default, "auto" backend)."""
    from trl_fp8.rollout.vllm._compat import XQA_DECODE_NAMES, route_xqa_scales
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    assert dict(XQA_DECODE_NAMES)["trtllm_batch_decode_with_kv_cache"] == {"kv_layout": "HND", "backend": "auto"}
    layer = _scale_layer()
    live = LiveXQAScales(1.0, 64)
    live.refresh(layer)
    seen = []
    decode = route_xqa_scales(lambda *a, **k: seen.append(k), kv_layout="HND", backend="auto")
    vllm_026 = dict(o_sf_scale=None, q_len_per_req=1, kv_cache_sf=None, lse=None, return_lse=False)  # fmt: skip
    inputs = _decode_inputs("HND")
    decode(**inputs, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, backend="xqa", sinks=None, **vllm_026)
    assert not seen and fake_xqa[-1]["kv_layout"] == "HND" and fake_xqa[-1]["page_size"] == 16
    for backend in ({"backend": "trtllm-gen"}, {}):  # trtllm-gen, or "auto" (left to FlashInfer)
        decode(**inputs, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, **backend, **vllm_026)
    decode(
        **inputs, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, backend="xqa", **{**vllm_026, "return_lse": True}
    )
    assert len(seen) == 3 and len(fake_xqa) == 1


def test_the_direct_call_needs_xqas_keywords_of_flashinfer_0614_and_07(fake_xqa, monkeypatch):
    from trl_fp8.rollout.vllm._compat import flashinfer_xqa_kernel_missing

    assert flashinfer_xqa_kernel_missing() is None
    monkeypatch.setattr(sys.modules["flashinfer.xqa"], "xqa", lambda q, k_cache, v_cache, q_scale=1.0: None)
    assert "takes no ['enable_pdl', 'kv_layout', 'kv_scale'" in flashinfer_xqa_kernel_missing()
    monkeypatch.setitem(sys.modules, "flashinfer.xqa", None)
    assert "no flashinfer.xqa.xqa" in flashinfer_xqa_kernel_missing()


# vLLM's FlashInfer backend module, reduced to what `xqa_backend` builds on; its forward's XQA decode branch calls
# the module-level name, as vLLM 0.31's does (`decode_with_xqa`).
FAKE_VLLM_FLASHINFER = """
import torch

def flashinfer_xqa_batch_decode_with_kv_cache(**kwargs):
    raise AssertionError("the direct path was expected")

class FlashInferBackend:
    pass

class FlashInferMetadataBuilder:
    def __init__(self, *args, **kwargs):
        pass

class FlashInferImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype):
        self.head_size, self.scale, self.kv_cache_dtype = head_size, float(scale), kv_cache_dtype
        self.bmm2_scale = None

    def get_xqa_bmm1_scale(self, layer, q_data_type):
        return self.scale * layer._k_scale_float

    def process_weights_after_loading(self, act_dtype):
        pass

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # the profile run
            return output.fill_(0)
        flashinfer_xqa_batch_decode_with_kv_cache(
            query=query, kv_cache=kv_cache, workspace_buffer=attn_metadata["workspace"],
            block_tables=attn_metadata["block_tables"], seq_lens=attn_metadata["seq_lens"], max_seq_len=32,
            bmm1_scale=self.get_xqa_bmm1_scale(layer, torch.bfloat16), bmm2_scale=self.bmm2_scale, window_left=-1,
            out=output, sinks=None, kv_layout="NHD", q_len_per_req=1, mask=None, q_cu_seq_lens=None,
        )
        return output
"""


@pytest.fixture
def xqa_backend(monkeypatch, fake_xqa):
    """`trl_fp8.rollout.vllm.xqa_backend` imported over a stand-in of vLLM's FlashInfer backend module."""
    backend = types.ModuleType("vllm.v1.attention.backends.flashinfer")
    exec(FAKE_VLLM_FLASHINFER, backend.__dict__)
    parents = ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.utils")
    modules = {name: types.ModuleType(name) for name in parents}
    modules["vllm.v1.attention.backends"].flashinfer = backend
    modules[backend.__name__] = backend
    modules["vllm.utils.flashinfer"] = types.ModuleType("vllm.utils.flashinfer")  # no caches to clear
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "trl_fp8.rollout.vllm.xqa_backend", raising=False)
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # importing it updates these; restored after the test
    monkeypatch.delenv("VLLM_HAS_FLASHINFER_CUBIN", raising=False)
    import trl_fp8.rollout.vllm.xqa_backend as module

    monkeypatch.delitem(sys.modules, "trl_fp8.rollout.vllm.xqa_backend")
    return module, backend


def _impl(module, head_dim=64):
    return module.LiveScaleFlashInferImpl(8, head_dim, head_dim**-0.5, 2, None, None, "fp8")


def test_the_backends_decode_reaches_xqa_with_scales_refreshed_outside_capture(xqa_backend, fake_xqa, monkeypatch):
    module, backend = xqa_backend
    assert backend.flashinfer_xqa_batch_decode_with_kv_cache.trl_fp8_routes_xqa_scales is not None
    routed = backend.flashinfer_xqa_batch_decode_with_kv_cache
    from trl_fp8.rollout.vllm._compat import route_xqa_scales_in_vllm

    assert route_xqa_scales_in_vllm() == "flashinfer_xqa_batch_decode_with_kv_cache"
    assert backend.flashinfer_xqa_batch_decode_with_kv_cache is routed  # wrapped once
    impl, layer = _impl(module), _scale_layer(0.004, 0.006)
    inputs = _decode_inputs()
    metadata = {"workspace": inputs["workspace_buffer"], "block_tables": inputs["block_tables"],
                "seq_lens": inputs["seq_lens"]}  # fmt: skip
    impl.forward(layer, inputs["query"], None, None, inputs["kv_cache"], None, inputs["out"])  # the profile run
    q_scale = impl.live_xqa_scales.scales.q_scale
    assert q_scale.item() == pytest.approx(0.004 / 0.006, rel=1e-6) and impl.bmm2_scale is layer._v_scale
    impl.forward(layer, inputs["query"], None, None, inputs["kv_cache"], metadata, inputs["out"])
    assert fake_xqa[-1]["q_scale"] is q_scale and fake_xqa[-1]["kv_scale"] is layer._v_scale

    layer._k_scale.fill_(0.012)  # a sync's new scales ...
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    impl.forward(layer, inputs["query"], None, None, inputs["kv_cache"], metadata, inputs["out"])  # ... captured
    assert fake_xqa[-1]["q_scale"] is q_scale and q_scale.item() == pytest.approx(0.004 / 0.006, rel=1e-6)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    impl.process_weights_after_loading(torch.bfloat16)  # vLLM's layerwise reload, after it rewrote the scales
    assert q_scale.item() == pytest.approx(2.0, rel=1e-6) and impl.live_xqa_scales.scales.q_scale is q_scale
    layer._v_scale.fill_(0.003)
    impl.forward(layer, inputs["query"], None, None, inputs["kv_cache"], metadata, inputs["out"])  # an eager call
    assert q_scale.item() == pytest.approx(4.0, rel=1e-6) and len(fake_xqa) == 3


def test_the_backend_falls_back_to_computed_scales_before_any_refresh_and_leaves_other_caches_to_vllm(xqa_backend):
    module, _ = xqa_backend
    impl, layer = _impl(module), _scale_layer(0.004, 0.006)
    layer._q_scale, layer._k_scale_float = torch.tensor(0.5), 0.004
    impl.process_weights_after_loading(torch.bfloat16)  # at load: no forward yet, no layer to read
    assert impl.live_xqa_scales.scales is None
    bmm1 = impl.get_xqa_bmm1_scale(layer, torch.bfloat16)  # first seen under capture: tensors, computed in the graph
    assert isinstance(bmm1, torch.Tensor) and bmm1.item() == pytest.approx(0.004 / 8)
    assert impl.get_xqa_bmm1_scale(layer, torch.float8_e4m3fn).item() == pytest.approx(0.004 / 8 * 0.5)
    impl.live_xqa_scales.refresh(layer)
    assert impl.get_xqa_bmm1_scale(layer, torch.bfloat16) is impl.live_xqa_scales.scales
    assert impl.get_xqa_bmm1_scale(layer, torch.float8_e4m3fn).item() == pytest.approx(0.004 / 8 * 0.5)
    bf16_cache = module.LiveScaleFlashInferImpl(8, 64, 0.125, 2, None, None, "auto")
    assert bf16_cache.get_xqa_bmm1_scale(layer, torch.bfloat16) == pytest.approx(0.125 * 0.004)  # vLLM's own
