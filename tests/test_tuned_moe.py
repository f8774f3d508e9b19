"""trl-fp8's tuned Triton tiles for vLLM's block-FP8 fused MoE: handed to vLLM through `VLLM_TUNED_CONFIG_FOLDER`
(colocated engines and the plugin every vLLM process loads), never over a user's own folder, and in vLLM's format."""

import json
import os
from pathlib import Path

import tomllib

from trl_fp8.rollout.vllm import tuned_moe

ROOT = Path(__file__).resolve().parents[1]
TILE_KEYS = {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"}


def test_the_folder_is_named_only_where_a_file_ships_and_the_user_named_none(monkeypatch, tmp_path):
    monkeypatch.setattr(tuned_moe, "TUNED_MOE_CONFIGS", tmp_path)
    assert tuned_moe.tuned_moe_config_env({}) == {}  # nothing shipped: vLLM's own files
    (tmp_path / "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json").write_text("{}")
    assert tuned_moe.tuned_moe_config_env({}) == {"VLLM_TUNED_CONFIG_FOLDER": str(tmp_path)}
    assert tuned_moe.tuned_moe_config_env({"VLLM_TUNED_CONFIG_FOLDER": "/mine"}) == {}


def test_fp8_engines_and_vllm_processes_get_the_folder_bf16_engines_do_not(monkeypatch, tmp_path):
    from trl_fp8.rollout.vllm import kernels as vk
    from trl_fp8.rollout.vllm import plugin
    from trl_fp8.rollout.vllm.engine import engine_env

    monkeypatch.setattr(tuned_moe, "TUNED_MOE_CONFIGS", tmp_path)
    (tmp_path / "E=8,N=128,device_name=X,dtype=fp8_w8a8,block_shape=[128,128].json").write_text("{}")
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    kernel = vk.RolloutKernel("cutlass", "test", {"VLLM_USE_DEEP_GEMM": "0", **vk.NO_E8M0})
    assert engine_env("fp8", kernel) == {**kernel.env, "VLLM_TUNED_CONFIG_FOLDER": str(tmp_path)}
    assert engine_env("bf16", kernel) == {}
    monkeypatch.setattr("trl_fp8.rollout.vllm._compat.register_custom_attention", lambda path: None)
    plugin.register()
    assert os.environ["VLLM_TUNED_CONFIG_FOLDER"] == str(tmp_path)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", "/mine")
    plugin.register()
    assert os.environ["VLLM_TUNED_CONFIG_FOLDER"] == "/mine"
    assert "VLLM_TUNED_CONFIG_FOLDER" not in engine_env("fp8", kernel)


def test_shipped_files_are_vllms_format_and_travel_with_the_package():
    """Each file: vLLM's name for block-FP8 experts, token counts as keys, a full Triton tile each, N and K tiles that
    a 128x128 weight block holds whole (the Triton kernel reads one scale per block)."""
    for name in tuned_moe.tuned_moe_config_files():
        assert name.startswith("E=") and name.endswith(",dtype=fp8_w8a8,block_shape=[128,128].json"), name
        entries = json.loads((tuned_moe.TUNED_MOE_CONFIGS / name).read_text())
        entries.pop("triton_version", None)
        assert entries and all(int(key) > 0 for key in entries)
        for tile in entries.values():
            assert set(tile) == TILE_KEYS, tile
            assert 128 % tile["BLOCK_SIZE_N"] == 0 and 128 % tile["BLOCK_SIZE_K"] == 0, tile
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "tuned_moe_configs/*.json" in package_data["trl_fp8.rollout.vllm"]
