"""The checks a trainer makes before joining a `trl vllm-serve` server (`trl_fp8.rollout.vllm.server`): the served
checkpoint's quantization and layers, its FP8 KV cache and attention backend, its kernel settings; each refusal names
the fix. The server's `/server_info` is one a real server returned on the GPU host (`data/vllm_server_info.json`)."""

import json
from pathlib import Path

import pytest
import torch

from trl_fp8 import convert_to_fp8
from trl_fp8.checkpoint.save import checkpoint_config, fp8_module_names, linear_module_names
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.rollout.vllm.server import check_server_config, check_server_kernel

from fake_vllm import fp8_model


def _server_info(tmp_path, model, quantization="fp8", cache_dtype="auto", *, online=False, **config_overrides):
    """The /server_info tree a real `trl vllm-serve` returned on the GPU host, pointed at a served folder here: our
    block-FP8 checkpoint of `model` when `quantization="fp8"`, or (`online=True`) the BF16 model vLLM quantizes."""
    info = json.loads((Path(__file__).parent / "data" / "vllm_server_info.json").read_text())
    served = tmp_path / f"served-{len(list(tmp_path.iterdir()))}"
    served.mkdir()
    config = {**model.config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    if quantization == "fp8" and not online:
        config = checkpoint_config(model, fp8_module_names(model), linear_module_names(model), torch.bfloat16)
    config.update(config_overrides)
    (served / "config.json").write_text(json.dumps(config))
    info["model_config"].update(model=str(served), quantization=quantization)
    info["cache_config"]["cache_dtype"] = cache_dtype
    return info


def test_server_checks_name_the_fix(tmp_path):
    model = fp8_model()
    check_server_config(_server_info(tmp_path, model), model, "fp8", fp8_kv_cache=False)
    check_server_config(_server_info(tmp_path, model, None), model, "bf16", fp8_kv_cache=False)
    check_server_config(_server_info(tmp_path, model, "fp8", "fp8"), model, "fp8", fp8_kv_cache=True)
    with pytest.raises(ValueError, match="trl-fp8 quantize"):
        check_server_config(_server_info(tmp_path, model, None), model, "fp8", fp8_kv_cache=False)
    with pytest.raises(ValueError, match="--quantization fp8"):
        check_server_config(_server_info(tmp_path, model, None), model, "fp8_online", fp8_kv_cache=False)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        check_server_config(_server_info(tmp_path, model, architectures=["LlamaForCausalLM"]), model, "fp8", False)
    with pytest.raises(ValueError, match="hidden_size=512"):
        check_server_config(_server_info(tmp_path, model, hidden_size=512), model, "fp8", False)
    with pytest.raises(ValueError, match="--kv_cache_dtype fp8 --attention-backend CUSTOM.*or FLASH_ATTN"):
        check_server_config(_server_info(tmp_path, model), model, "fp8", fp8_kv_cache=True)
    # FP8 attention must read the pushed q/k/v scales at every step: FlashAttention-3 and trl-fp8's XQA backend
    # (CUSTOM) do, vLLM's FlashInfer backend does not (its CUDA graphs keep the first scales).
    for backend, ok in (("FLASH_ATTN", True), ("AttentionBackendEnum.FLASH_ATTN", True), (None, True),
                        ("CUSTOM", True), ("AttentionBackendEnum.CUSTOM", True), ("FLASHINFER", False),
                        ("TRITON_ATTN", False)):  # fmt: skip
        info = {**_server_info(tmp_path, model, "fp8", "fp8"), "attention_config": {"backend": backend}}
        if ok:
            check_server_config(info, model, "fp8", fp8_kv_cache=True)
        else:
            with pytest.raises(
                ValueError, match=f"attention backend is '{backend}'.*--attention-backend CUSTOM.*FLASH_ATTN"
            ):
                check_server_config(info, model, "fp8", fp8_kv_cache=True)
        # An FP8 cache without the trainer's K/V scales would scale by 1.0: refused with the fix.
        with pytest.raises(ValueError, match="keeps its KV cache in 'fp8'.*Set fp8_kv_cache=True"):
            check_server_config(info, model, "fp8", fp8_kv_cache=False)
    info = {**_server_info(tmp_path, model), "attention_config": {"backend": "TRITON_ATTN"}}
    check_server_config(info, model, "fp8", fp8_kv_cache=False)  # a BF16 KV cache: any attention will do
    # FP8 kernel settings: E8M0 with DeepGEMM enabled changes our scales; any kernel without it keeps them.
    deepgemm = {"VLLM_USE_DEEP_GEMM": True, "VLLM_USE_DEEP_GEMM_E8M0": False}
    check_server_config(_server_info(tmp_path, model), model, "fp8", False, server_env=deepgemm)
    with pytest.raises(
        ValueError,
        match="VLLM_USE_DEEP_GEMM_E8M0=0 VLLM_MOE_USE_DEEP_GEMM=0 trl vllm-serve --model <fp8_dir> --linear-backend",
    ):
        check_server_config(
            _server_info(tmp_path, model), model, "fp8", False, server_env={"VLLM_USE_DEEP_GEMM": True}
        )
    cutlass = {"VLLM_USE_DEEP_GEMM": False, "VLLM_USE_DEEP_GEMM_E8M0": True}  # E8M0 is inert without DeepGEMM
    check_server_config(_server_info(tmp_path, model), model, "fp8", False, server_env=cutlass)
    check_server_config(_server_info(tmp_path, model, None), model, "bf16", False, server_env={})  # not FP8: no check
    # A server on another host: its folder is not readable here, so only what /server_info says is checked.
    remote = _server_info(tmp_path, model, hidden_size=512)
    remote["model_config"]["model"] = "/nonexistent/fp8"
    check_server_config(remote, model, "fp8", fp8_kv_cache=False)


def test_server_quantization_must_be_the_trainers_block_fp8_layout(tmp_path, caplog, monkeypatch):
    """vLLM reports quantization="fp8" for a block-FP8 checkpoint and for a BF16 model it quantizes online alike:
    the served model's own quantization_config tells them apart, and its high-precision layers must be ours."""
    model = fp8_model()
    online = _server_info(tmp_path, model, online=True)  # `--quantization fp8` on the BF16 model
    with pytest.raises(ValueError, match="quantizes a BF16 checkpoint itself.*trl-fp8 quantize"):
        check_server_config(online, model, "fp8", fp8_kv_cache=False)
    check_server_config(online, model, "fp8_online", fp8_kv_cache=False)
    # vLLM 0.31 spells its online FP8 `fp8_per_tensor` (it maps `--quantization fp8` of a BF16 model to it).
    check_server_config(_server_info(tmp_path, model, "fp8_per_tensor", online=True), model, "fp8_online", False)
    with pytest.raises(ValueError, match="pushes BF16 weights for vLLM to quantize, but the server serves a 'fp8'"):
        check_server_config(_server_info(tmp_path, model), model, "fp8_online", fp8_kv_cache=False)
    # A checkpoint with other BF16 layers than the trainer's (made without its num_first_layers_in_bf16=1).
    kept_first = tiny_qwen3()
    convert_to_fp8(kept_first, num_first_layers_in_bf16=1)
    with pytest.raises(
        ValueError, match=r"FP8 on the server: model.layers.0.mlp.down_proj.*--num_first_layers_in_bf16"
    ):
        check_server_config(_server_info(tmp_path, model), kept_first, "fp8", fp8_kv_cache=False)
    check_server_config(_server_info(tmp_path, kept_first), kept_first, "fp8", fp8_kv_cache=False)
    with pytest.raises(ValueError, match="FP8 in the trainer, BF16 on the server"):
        check_server_config(_server_info(tmp_path, kept_first), model, "fp8", fp8_kv_cache=False)
    # The trainer's export plan (BF16 training, FP8 rollouts) is what counts, when given.
    plain = tiny_qwen3()
    planned = fp8_module_names(kept_first)
    check_server_config(_server_info(tmp_path, kept_first), plain, "fp8", False, fp8_modules=planned)
    other_block = _server_info(tmp_path, model)
    served = Path(other_block["model_config"]["model"]) / "config.json"
    config = json.loads(served.read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    served.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size=\[64, 64\], not the 128x128 block FP8"):
        check_server_config(other_block, model, "fp8", fp8_kv_cache=False)
    # A server on another host serving a Hub id: its config.json comes from the Hub (here a stand-in download).
    import huggingface_hub

    remote = _server_info(tmp_path, model, online=True)
    folder = remote["model_config"]["model"]
    remote["model_config"]["model"] = "someone/tiny-bf16"
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, revision=None: f"{folder}/{name}")
    with pytest.raises(ValueError, match="quantizes a BF16 checkpoint itself"):
        check_server_config(remote, model, "fp8", fp8_kv_cache=False)

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with caplog.at_level("WARNING", logger="trl_fp8.rollout.vllm.generation"):
        check_server_config(remote, model, "fp8", fp8_kv_cache=False)
    assert "cannot be checked" in caplog.text


def test_server_kernel_check_reports_the_served_kernel_and_warns_on_another(caplog):
    config = {"kernel_config": {"linear_backend": "auto"}}
    deepgemm = {"VLLM_USE_DEEP_GEMM": True, "VLLM_USE_DEEP_GEMM_E8M0": False}
    assert check_server_kernel(config, deepgemm) == "deepgemm"
    assert check_server_kernel(config, {**deepgemm, "VLLM_USE_DEEP_GEMM": False}) == "auto"  # vLLM's own pick
    triton = {"kernel_config": {"linear_backend": "triton"}}
    with caplog.at_level("WARNING", logger="trl_fp8.rollout.vllm.generation"):
        assert check_server_kernel(triton, deepgemm, "deepgemm") == "triton"
    assert "runs 'triton'" in caplog.text and "--linear-backend deep_gemm" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_fp8.rollout.vllm.generation"):
        assert check_server_kernel(config, None) is None  # an older server that does not report its settings
    assert "cannot be checked" in caplog.text


def test_online_fp8_is_named_as_the_installed_vllm_names_it(tmp_path, monkeypatch):
    """`--quantization fp8` on a BF16 model is deprecated from vLLM 0.31 for `fp8_per_tensor`; older releases know
    only the first. The engine asks for, and a server's error message names, the installed release's spelling."""
    from trl_fp8.rollout.vllm import _compat
    from trl_fp8.rollout.vllm.engine import engine_overrides

    model = fp8_model()
    for release, name in (((0, 26), "fp8"), ((0, 31), "fp8_per_tensor")):
        monkeypatch.setattr(_compat, "installed_vllm_release", lambda release=release: release)
        assert _compat.online_fp8_quantization() == name
        assert engine_overrides(str(tmp_path), "fp8_online", False)["quantization"] == name
        with pytest.raises(ValueError, match=f"Restart `trl vllm-serve` with --quantization {name}"):
            check_server_config(_server_info(tmp_path, model, None), model, "fp8_online", fp8_kv_cache=False)
