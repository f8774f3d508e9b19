"""The rollout kernel choice: DeepGEMM on Hopper when it can run, Cutlass otherwise, E8M0 off in every case."""

import shutil

import pytest
import torch

import trl_fp8.rollout.vllm.kernels as vk
from trl_fp8 import FP8GRPOConfig
from trl_fp8.rollout.vllm.kernels import check_fp8_kv_attention, rollout_kernel, server_command, server_kernel


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    """A machine that looks like the GPU host: an SM90 GPU, vLLM with its bundled DeepGEMM, nvcc on CUDA_HOME."""
    vllm_pkg = tmp_path / "site" / "vllm"
    (vllm_pkg / "third_party" / "deep_gemm").mkdir(parents=True)
    (vllm_pkg / "third_party" / "deep_gemm" / "__init__.py").write_text("__version__ = '2.8.0'\n")  # vLLM 0.31's
    (vllm_pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(__import__("sys").modules, "vllm", raising=False)
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    fake_nvcc(cuda / "bin" / "nvcc", "13.0")
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name in ("DG_JIT_CACHE_DIR", "VLLM_CACHE_ROOT", "VLLM_DEEP_GEMM_WARMUP", "VLLM_MOE_USE_DEEP_GEMM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def fake_nvcc(path, release: str) -> None:
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
    path.chmod(0o755)


def test_auto_picks_deepgemm_on_hopper_with_e8m0_off_and_a_persistent_cache(hopper):
    kernel = rollout_kernel("auto")
    assert kernel.backend == "deepgemm" and kernel.llm_kwargs == {"linear_backend": "deep_gemm"}
    assert kernel.env == {
        "VLLM_USE_DEEP_GEMM": "1",
        "VLLM_USE_DEEP_GEMM_E8M0": "0",
        "DG_JIT_CACHE_DIR": str(hopper / "cache" / "vllm" / "deep_gemm"),  # vLLM's own default location
        "VLLM_DEEP_GEMM_WARMUP": "full",
        "VLLM_MOE_USE_DEEP_GEMM": "0",  # experts on vLLM's preferred MoE kernel, not DeepGEMM's grouped one
    }
    assert rollout_kernel("deepgemm", jit_cache_dir=hopper / "dg").env["DG_JIT_CACHE_DIR"] == str(hopper / "dg")


def test_user_settings_for_cache_and_warmup_are_kept(hopper, monkeypatch):
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(hopper / "mine"))
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "relax")
    monkeypatch.setenv("VLLM_MOE_USE_DEEP_GEMM", "1")
    env = rollout_kernel("auto").env
    assert env["DG_JIT_CACHE_DIR"] == str(hopper / "mine") and env["VLLM_DEEP_GEMM_WARMUP"] == "relax"
    assert env["VLLM_MOE_USE_DEEP_GEMM"] == "1"


@pytest.mark.parametrize(
    "breakage, reason",
    [
        ("no_nvcc", "nvcc"),
        ("old_nvcc", "nvcc >= 12.9"),
        ("ada", "sm_89"),
        ("blackwell", "sm_100"),
        ("no_deepgemm", "no bundled DeepGEMM"),
        ("no_gpu", "no CUDA GPU"),
    ],
)
def test_auto_falls_back_to_cutlass_with_the_reason_and_deepgemm_refuses(hopper, monkeypatch, breakage, reason):
    if breakage == "no_nvcc":
        monkeypatch.setenv("CUDA_HOME", str(hopper / "nowhere"))
    elif breakage == "old_nvcc":  # DeepGEMM 2.8 (vLLM 0.31) compiles with nvcc 12.9 or newer
        fake_nvcc(hopper / "cuda" / "bin" / "nvcc", "12.8")
    elif breakage in ("ada", "blackwell"):
        cap = (8, 9) if breakage == "ada" else (10, 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    elif breakage == "no_deepgemm":
        shutil.rmtree(hopper / "site" / "vllm" / "third_party" / "deep_gemm")
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kernel = rollout_kernel("auto")
    assert kernel.backend == "cutlass" and reason in kernel.reason
    assert kernel.env == {"VLLM_USE_DEEP_GEMM": "0", "VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert kernel.llm_kwargs == {"linear_backend": "cutlass"}
    with pytest.raises(ValueError, match=f"cannot run here: .*{reason}.*vllm_fp8_backend='cutlass'"):
        rollout_kernel("deepgemm")


@pytest.mark.parametrize("backend", ["cutlass", "triton"])
def test_explicit_backends_keep_deepgemm_off(backend):
    kernel = rollout_kernel(backend)
    assert kernel.backend == backend and kernel.llm_kwargs == {"linear_backend": backend}
    assert kernel.env == {"VLLM_USE_DEEP_GEMM": "0", "VLLM_USE_DEEP_GEMM_E8M0": "0"}


@pytest.mark.parametrize("moe", ["triton", "flashinfer_cutlass", "deepgemm"])
def test_moe_backend_reaches_the_engine_beside_the_linear_kernel(hopper, moe):
    """`vllm_fp8_moe_backend`: vLLM's `moe_backend` next to the linear kernel's settings, the reason saying it was
    asked for; DeepGEMM's grouped MoE also needs vLLM's switch for it. "auto" passes nothing (vLLM's choice)."""
    kernel = rollout_kernel("auto", moe_backend=moe)
    vllm_name = {"deepgemm": "deep_gemm"}.get(moe, moe)
    assert kernel.llm_kwargs == {"linear_backend": "deep_gemm", "moe_backend": vllm_name}
    assert kernel.env["VLLM_MOE_USE_DEEP_GEMM"] == ("1" if moe == "deepgemm" else "0")
    assert kernel.env["VLLM_USE_DEEP_GEMM_E8M0"] == "0" and f"experts on {moe} (requested)" in kernel.reason
    assert rollout_kernel("auto", moe_backend="auto") == rollout_kernel("auto")
    assert ("many minutes to start" in kernel.reason) == (moe == "flashinfer_cutlass")  # said before the silent wait


def test_deepgemm_experts_need_deepgemm_linear_layers_and_unknown_names_are_refused(hopper):
    with pytest.raises(ValueError, match="linear layers run on cutlass.*vllm_fp8_backend='deepgemm'"):
        rollout_kernel("cutlass", moe_backend="deepgemm")
    assert rollout_kernel("cutlass", moe_backend="triton").llm_kwargs == {"linear_backend": "cutlass",
                                                                          "moe_backend": "triton"}  # fmt: skip
    with pytest.raises(ValueError, match="vllm_fp8_moe_backend='marlin' is unknown"):
        rollout_kernel("auto", moe_backend="marlin")


def test_cutlass_experts_which_vllm_will_not_run_are_refused_before_the_engine_starts(hopper):
    """vLLM 0.26's block-FP8 MoE method disables its CUTLASS kernel: the engine stopped at start-up (4 x H200,
    2026-11-28). The trainer says so, and what to use, before loading anything."""
    from trl_fp8 import FP8GRPOConfig

    with pytest.raises(ValueError, match="CUTLASS FP8 MoE kernel off for block-FP8 .* Use 'auto'"):
        rollout_kernel("auto", moe_backend="cutlass")
    with pytest.raises(ValueError, match="vllm_fp8_moe_backend='cutlass': vLLM 0.26 turns"):
        FP8GRPOConfig(output_dir="unused", use_cpu=True, vllm_fp8_moe_backend="cutlass")


def test_server_command_names_the_kernel_settings():
    assert server_command() == (
        "VLLM_USE_DEEP_GEMM=1 VLLM_USE_DEEP_GEMM_E8M0=0 VLLM_MOE_USE_DEEP_GEMM=0 trl vllm-serve --model <fp8_dir> "
        "--linear-backend deep_gemm"
    )
    assert server_command(server_kernel("cutlass"), "out/fp8").endswith("--model out/fp8 --linear-backend cutlass")
    with pytest.raises(ValueError, match="unknown"):
        server_kernel("marlin")


def test_config_validates_the_backend():
    with pytest.raises(ValueError, match="unknown"):
        FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, vllm_fp8_backend="marlin")
    with pytest.raises(ValueError, match="vllm_fp8_backend='deepgemm' sets up vLLM rollouts, but use_vllm=False"):
        FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, fp8_recipe=None, vllm_fp8_backend="deepgemm")
    assert FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False).vllm_fp8_backend == "auto"


def test_nvcc_is_found_where_deepgemm_looks(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", str(tmp_path))
    assert vk._find_nvcc() is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert vk._find_nvcc() == str(tmp_path / "bin" / "nvcc")
    monkeypatch.setenv("DG_JIT_NVCC_COMPILER", str(tmp_path / "mine"))  # DeepGEMM 2.8's own setting comes first
    assert vk._find_nvcc() is None
    (tmp_path / "mine").write_text("")
    assert vk._find_nvcc() == str(tmp_path / "mine")


def test_fp8_kv_cache_needs_hopper_attention(hopper, monkeypatch):
    check_fp8_kv_attention()  # SM90: FlashAttention-3 FP8
    for cap in ((8, 9), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        with pytest.raises(ValueError, match=f"sm_{cap[0]}{cap[1]}.*Set fp8_kv_cache=False"):
            check_fp8_kv_attention()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_fp8_kv_attention()  # no GPU: vLLM itself refuses


def test_engine_settings_reach_decisions_vllm_cached_earlier(monkeypatch):
    """vLLM caches "is DeepGEMM usable" (functools.cache) from the environment of its first question. The trainer's
    DeepGEMM GEMMs may ask first, under VLLM_USE_DEEP_GEMM=0; the engine's own setting must still win (the GPU suite
    saw the engine refuse DeepGEMM otherwise). A stand-in for `vllm.utils.deep_gemm` with the same caches."""
    import functools
    import os
    import sys
    import types

    from trl_fp8.rollout.vllm.engine import apply_engine_env

    fake = types.ModuleType("vllm.utils.deep_gemm")
    fake.is_deep_gemm_supported = functools.cache(lambda: os.environ.get("VLLM_USE_DEEP_GEMM") == "1")
    fake.is_deep_gemm_e8m0_used = functools.cache(lambda: os.environ.get("VLLM_USE_DEEP_GEMM_E8M0") == "1")
    fake.DeepGemmQuantScaleFMT = type("DeepGemmQuantScaleFMT", (), {"_oracle_cache": "asked before"})
    monkeypatch.setitem(sys.modules, "vllm.utils.deep_gemm", fake)
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "1")
    assert not fake.is_deep_gemm_supported() and fake.is_deep_gemm_e8m0_used()  # cached under the old settings

    kernel = vk.RolloutKernel("deepgemm", "test", {"VLLM_USE_DEEP_GEMM": "1", **vk.NO_E8M0})
    apply_engine_env("fp8", kernel)
    assert fake.is_deep_gemm_supported() and not fake.is_deep_gemm_e8m0_used()
    assert fake.DeepGemmQuantScaleFMT._oracle_cache is None
