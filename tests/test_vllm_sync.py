"""What the trainer pushes to vLLM (which tensors, which names, which dtypes, which bits), the KV-scale observer, the
engine start-up folder, the server checks, and the trainer wiring, on CPU without vLLM (a fake `LLM` records what
TRL's code hands it)."""

import json
import logging
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Linear, convert_to_fp8
from trl_fp8.checkpoint.save import checkpoint_config, fp8_module_names, linear_module_names
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
from trl_fp8.rollout.kv_scales import AttentionScaleObserver
from trl_fp8.rollout.vllm.generation import (
    FP8VLLMGeneration,
    check_server_config,
    check_server_kernel,
    check_vllm_version,
    rollout_weight_tensors,
    write_engine_config,
)

from conftest import assert_fp8_equal, layer_names


def fp8_model(**kwargs):
    model = tiny_qwen3(**kwargs)
    convert_to_fp8(model)
    return model


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


def _reference_qkv(model, ids):
    """q (after q_norm and RoPE), k (after k_norm and RoPE) and v of every layer, recomputed from the layer inputs."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    captured, handles = {}, []
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, kwargs, i=i):
            captured[i] = (kwargs["hidden_states"], kwargs["position_embeddings"])

        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
        out = {}
        for i, (h, (cos, sin)) in captured.items():
            attn = model.model.layers[i].self_attn
            shape = (*h.shape[:-1], -1, attn.head_dim)
            q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out[i] = (q, k, v)
    for handle in handles:
        handle.remove()
    return out


def test_kv_observer_measures_q_k_v_exactly_as_attention_sees_them_without_changing_the_model():
    model = tiny_qwen3()
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        before = model(ids).logits
    observer = AttentionScaleObserver(model)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    scales = observer.scales()
    assert list(scales) == sorted(f"model.layers.{i}.self_attn.{x}_scale" for i in range(4) for x in "qkv")
    reference = _reference_qkv(model, ids)
    for i, (q, k, v) in reference.items():
        for leaf, x in zip("qkv", (q, k, v), strict=True):
            expected = x.abs().amax().item() / 448.0
            assert scales[f"model.layers.{i}.self_attn.{leaf}_scale"].item() == pytest.approx(expected, rel=1e-6)
    # Nothing ran since: the same scales again. A forward on larger inputs raises them (running max per sync).
    assert all(torch.equal(a, b) for a, b in zip(observer.scales().values(), scales.values(), strict=True))
    with torch.no_grad():
        model(ids * 0 + 7)
        model(ids)
        model.model.embed_tokens.weight.mul_(3.0)
        model(ids)
    assert observer.scales()["model.layers.0.self_attn.v_scale"] > scales["model.layers.0.self_attn.v_scale"]


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
    with pytest.raises(ValueError, match="--kv_cache_dtype fp8 --attention-backend FLASH_ATTN"):
        check_server_config(_server_info(tmp_path, model), model, "fp8", fp8_kv_cache=True)
    # FP8 attention must read the pushed q/k/v scales at every step: FlashAttention-3 does, FlashInfer does not.
    for backend, ok in (("FLASH_ATTN", True), ("AttentionBackendEnum.FLASH_ATTN", True), (None, True),
                        ("FLASHINFER", False), ("TRITON_ATTN", False)):  # fmt: skip
        info = {**_server_info(tmp_path, model, "fp8", "fp8"), "attention_config": {"backend": backend}}
        if ok:
            check_server_config(info, model, "fp8", fp8_kv_cache=True)
        else:
            with pytest.raises(ValueError, match=f"attention backend is '{backend}'.*--attention-backend FLASH_ATTN"):
                check_server_config(info, model, "fp8", fp8_kv_cache=True)
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


def test_vllm_version_errors_name_the_fix(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.25.1")
    with pytest.raises(ImportError, match="arrived in 0.26"):
        check_vllm_version()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.26.0")
    assert check_vllm_version() == "0.26.0"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'trl-fp8\[vllm\]'"):
        check_vllm_version()
    # Refused by the config itself, before a script can write anything for a run that cannot start.
    with pytest.raises(ImportError, match="use_vllm=True needs vLLM"):
        FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, use_vllm=True)


class FakeLLM:
    """Stands in for vllm.LLM: records how TRL's code built it and what a sync pushed."""

    instances = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in ("VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0")}
        self.pushed = []
        self.reloads = 0
        worker = types.SimpleNamespace(reload_weights=self._reload)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker))
        )
        FakeLLM.instances.append(self)

    def _reload(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.pushed = [(n, t.clone()) for n, t in weights_iterator]
        self.reloads += 1
        if getattr(self, "on_reload", None):
            self.on_reload(self.pushed)

    def reset_prefix_cache(self):
        pass

    def sleep(self, level):
        self.asleep = True

    def wake_up(self, tags=None):
        self.asleep = False


@pytest.fixture
def fake_vllm(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    import trl_fp8.config
    import trl_fp8.rollout.vllm.generation as sync

    FakeLLM.instances.clear()
    # TRL's colocate set-up exports these for vLLM; undo that, or later subprocesses would think they are ranks.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(trl_vllm, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(sync, "check_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(trl_fp8.config, "check_vllm_version", lambda: "0.26.0")
    return FakeLLM


@pytest.mark.parametrize(
    "precision, kv, expected",
    [
        (
            "fp8",
            True,
            {
                "load_format": "dummy",
                "kv_cache_dtype": "fp8",
                "quantization": None,
                "linear_backend": "cutlass",
                "attention_backend": "FLASH_ATTN",
            },  # FA3: the FP8 attention that takes new q/k/v scales each sync
        ),
        (
            "fp8_online",
            False,
            {"load_format": "dummy", "quantization": "fp8", "linear_backend": None, "attention_backend": None},
        ),
        (
            "bf16",
            False,
            {"load_format": "dummy", "quantization": None, "linear_backend": None, "attention_backend": None},
        ),
    ],
)
def test_trainer_builds_vllm_from_a_config_folder_and_pushes_its_rollout_tensors(
    fake_vllm, tmp_path, monkeypatch, precision, kv, expected
):
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "1")  # vLLM 0.26's own default: the trainer must override it
    tokenizer = tiny_char_tokenizer()
    model = tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    args = FP8GRPOConfig(
        **{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path), use_cpu=True, bf16=False,
        use_vllm=True, vllm_mode="colocate", rollout_precision=precision, fp8_kv_cache=kv,
        fp8_recipe="none" if precision == "fp8_online" else "blockwise",
    )  # fmt: skip
    trainer = FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                             processing_class=tokenizer)  # fmt: skip
    generation = trainer.vllm_generation
    assert isinstance(generation, FP8VLLMGeneration) and generation.rollout_precision == precision
    (llm,) = fake_vllm.instances
    for key, value in expected.items():
        assert llm.kwargs.get(key) == value, key
    assert llm.kwargs["model"] == str(generation.engine_dir)
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"  # TRL's own settings pass through
    if precision == "fp8":  # no GPU here: "auto" falls back from DeepGEMM to Cutlass; E8M0 off in every case
        assert llm.env == {"VLLM_USE_DEEP_GEMM": "0", "VLLM_USE_DEEP_GEMM_E8M0": "0"}
        assert generation.kernel.backend == "cutlass" and "no CUDA GPU" in generation.kernel.reason
    config = json.loads((generation.engine_dir / "config.json").read_text())
    assert ("quantization_config" in config) == (precision == "fp8")

    if kv:  # before the first rollout the trainer measures the KV scales on the prompts
        trainer._calibrate_kv_scales([[1, 2, 3], [4, 5]])
    generation.sync_weights()
    pushed = dict(llm.pushed)
    assert generation.last_sync_seconds is not None and llm.reloads == 1
    hf_model = trainer.model
    if precision == "fp8":
        down = "model.layers.2.mlp.down_proj"
        assert_fp8_equal(
            pushed[f"{down}.weight"], pushed[f"{down}.weight_scale_inv"], hf_model.get_submodule(down).weight
        )
        assert pushed["model.layers.3.self_attn.k_scale"].item() > 0
    else:
        assert not any(t.dtype == torch.float8_e4m3fn for t in pushed.values())
        assert torch.equal(
            pushed["model.layers.2.mlp.down_proj.weight"],
            hf_model.model.layers[2].mlp.down_proj.weight.to(torch.bfloat16),
        )
    # TRL's own importance-sampling switch is left as the config set it.
    assert trainer.vllm_importance_sampling_correction is args.vllm_importance_sampling_correction


def _tiny_trainer(tmp_path, model=None, **kwargs):
    tokenizer = tiny_char_tokenizer()
    model = model or tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    peft_config = kwargs.pop("peft_config", None)
    settings = {**GRPO_SETTINGS, "per_device_train_batch_size": 16, **kwargs}
    args = FP8GRPOConfig(**settings, output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True,
                         vllm_mode="colocate")  # fmt: skip
    return FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                          processing_class=tokenizer, peft_config=peft_config)  # fmt: skip


@pytest.mark.parametrize("sleep_mode", [True, False])
def test_sleep_mode_rollouts_let_go_of_the_fp8_weight_copies_and_training_requantizes_the_same_bits(
    fake_vllm, tmp_path, sleep_mode
):
    """In sleep mode vLLM's KV cache wakes after the sync: the trainer lets go of its cached FP8 weights (their bytes
    go to the cache), and the next forward quantizes the unchanged weights to the very bits the engine holds."""
    trainer = _tiny_trainer(tmp_path, vllm_enable_sleep_mode=sleep_mode)
    generation, model = trainer.vllm_generation, trainer.model
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert all(m._fp8_weight_cache is not None for m in layers)
    generation.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    cached = [m._fp8_weight_cache is not None for m in layers]
    expected = sum(m.weight.numel() + 4 * m.weight.numel() // 128**2 for m in layers)
    assert generation.released_cache_bytes == (expected if sleep_mode else 0)
    assert not any(cached) if sleep_mode else all(cached)
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            q, scale_inv = module.quantized_weight()
            assert torch.equal(q.view(torch.uint8), pushed[f"{name}.weight"].view(torch.uint8))
            assert torch.equal(scale_inv, pushed[f"{name}.weight_scale_inv"])


class FakeMoEEngine:
    """A colocated engine's MoE layers as vLLM's block-FP8 `Fp8MoEMethod` holds them (w13 = gate rows then up rows),
    under the transformers names, filled from the pushed per-expert checkpoint tensors as vLLM's loader fills them."""

    def __init__(self, experts_layers: dict[str, torch.nn.Module]):
        self.model, self.layers = torch.nn.Module(), {}
        for name, ours in experts_layers.items():
            e, two_i, h = ours.gate_up_proj.shape
            layer = torch.nn.Module()
            layer.quant_method = types.SimpleNamespace(fp8_backend="TRITON", weight_scale_name="weight_scale_inv")
            for key, shape, dtype in [("w13_weight", (e, two_i, h), torch.float8_e4m3fn),
                                      ("w13_weight_scale_inv", (e, two_i // 128, h // 128), torch.float32),
                                      ("w2_weight", (e, h, two_i // 2), torch.float8_e4m3fn),
                                      ("w2_weight_scale_inv", (e, h // 128, two_i // 256), torch.float32)]:  # fmt: skip
                layer.register_parameter(key, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
            parent = self.model
            for part in name.split(".")[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(name.rsplit(".", 1)[1], layer)
            self.layers[name] = layer

    def load(self, pushed):
        for name, tensor in pushed:
            prefix, sep, rest = name.partition(".experts.")
            layer = self.layers.get(prefix + ".experts")
            if layer is None or not sep:
                continue
            expert, proj, leaf = rest.split(".", 2)
            target = getattr(layer, ("w2" if proj == "down_proj" else "w13") + "_" + leaf)
            half = target.shape[1] // 2
            rows = {"gate_proj": slice(0, half), "up_proj": slice(half, 2 * half)}.get(proj, slice(None))
            target.data[int(expert), rows].copy_(tensor)


def test_fp8_experts_are_written_in_place_once_proven_bit_for_bit(fake_vllm, tmp_path, monkeypatch, caplog):
    """MoE syncs: the first pushes every expert tensor through the reload, then checks that vLLM's own kernel-format
    conversion of the stacked FP8 experts gives the engine's tensors bit for bit; later syncs leave the experts out of
    the reload and write them in place (the engine then holds the updated experts' FP8 bits). A conversion that
    gives other bits, or sleep mode (level 2 discards the engine's layers), keeps every sync on the reload path, with
    a warning saying why."""
    from test_fp8_experts import tiny_moe

    import trl_fp8.rollout.vllm.experts as vllm_experts
    from trl_fp8.nn.experts import FP8Experts
    from trl_fp8.nn.linear import invalidate_fp8_weights

    def identity(fp8_backend, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale):
        return w13, w2, w13_scale, w2_scale  # vLLM's conversion for the Triton MoE backend keeps the layout

    def other_scales(**kwargs):
        w13, w2, w13_scale, w2_scale = identity(**kwargs)
        return w13, w2, w13_scale, w2_scale * 2

    for convert, sleep_mode, fast in ((identity, False, True), (other_scales, False, False), (identity, True, False)):
        monkeypatch.setattr(vllm_experts, "_vllm_converter", lambda convert=convert: convert)
        trainer = _tiny_trainer(tmp_path / f"{fast}{sleep_mode}", model=tiny_moe(), vllm_enable_sleep_mode=sleep_mode)
        generation, model = trainer.vllm_generation, trainer.model
        ours = {n: m for n, m in model.named_modules() if isinstance(m, FP8Experts)}
        assert list(ours) == ["model.layers.0.mlp.experts"]
        llm = fake_vllm.instances[-1]
        engine = FakeMoEEngine(ours)
        llm.llm_engine.model_executor.driver_worker.worker.model_runner = engine
        llm.on_reload = engine.load
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trl_fp8.rollout.vllm.generation"):
            generation.sync_weights()
        assert any(".experts.3.down_proj.weight_scale_inv" in n for n, _ in llm.pushed)
        assert bool(generation.engine_experts) is fast
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "FP8 experts sync" in r.message]
        assert len(warned) == (0 if fast else 1)
        experts = ours["model.layers.0.mlp.experts"]
        with torch.no_grad():  # a training step's worth of change
            experts.gate_up_proj.add_(torch.randn_like(experts.gate_up_proj) * 0.05)
            experts.down_proj.mul_(1.5)
        invalidate_fp8_weights(model)
        generation.sync_weights()
        assert any(".experts." in n for n, _ in llm.pushed) is not fast
        assert "model.layers.0.mlp.gate.weight" in dict(llm.pushed)  # the router always goes through the reload
        layer = engine.layers["model.layers.0.mlp.experts"]
        for ours_name, key in (("gate_up_proj", "w13"), ("down_proj", "w2")):
            q, s = experts.quantized_expert_weight(ours_name)
            assert torch.equal(getattr(layer, f"{key}_weight").view(torch.uint8), q.view(torch.uint8)), key
            assert torch.equal(getattr(layer, f"{key}_weight_scale_inv"), s.float()), key


def test_sleep_mode_without_expandable_segments_is_told_to_set_them(fake_vllm, tmp_path, caplog, monkeypatch):
    """PyTorch's allocator otherwise keeps freed training memory pinned while vLLM wakes into its share: the trainer
    names the setting once; with it set (any spelling PyTorch accepts), or without sleep mode, it says nothing."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with caplog.at_level(logging.WARNING):
        _tiny_trainer(tmp_path / "a", vllm_enable_sleep_mode=True)
    advice = [r.getMessage() for r in caplog.records if "expandable_segments" in r.getMessage()]
    assert len(advice) == 1 and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in advice[0]
    caplog.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True")
    with caplog.at_level(logging.WARNING):
        _tiny_trainer(tmp_path / "b", vllm_enable_sleep_mode=True)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    with caplog.at_level(logging.WARNING):
        _tiny_trainer(tmp_path / "c", vllm_enable_sleep_mode=False)
    assert not [r for r in caplog.records if "expandable_segments" in r.getMessage()]


def test_lora_fp8_rollouts_push_every_engine_fp8_layer_in_fp8(fake_vllm, tmp_path):
    """LoRA on q_proj only: the engine is configured with every projection in FP8, so q_proj (PEFT-wrapped, pushed
    as its merged weight) must arrive as FP8 with a scale like k_proj does, not as BF16."""
    from peft import LoraConfig

    trainer = _tiny_trainer(
        tmp_path, peft_config=LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), tis="token"
    )
    generation = trainer.vllm_generation
    config = json.loads((generation.engine_dir / "config.json").read_text())
    kept = set(config["quantization_config"]["modules_to_not_convert"])
    generation.sync_weights()
    (llm,) = fake_vllm.instances
    pushed = dict(llm.pushed)
    hf_model = trainer.model.get_base_model()
    engine_fp8 = {n for n, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    engine_fp8 = {n.removesuffix(".base_layer") for n in engine_fp8} - kept
    assert len(engine_fp8) == 28 and "model.layers.0.self_attn.q_proj" in engine_fp8
    for name in engine_fp8:
        module = hf_model.get_submodule(name)
        weight = module.base_layer.weight.detach() + module.get_delta_weight("default") if hasattr(
            module, "base_layer") else module.weight.detach()  # fmt: skip
        assert_fp8_equal(pushed[f"{name}.weight"], pushed[f"{name}.weight_scale_inv"], weight)
    assert not any("lora" in n or "base_layer" in n for n in pushed)


def test_bf16_training_fp8_rollouts_follow_the_runs_layer_choices(fake_vllm, tmp_path):
    """BF16 training, FP8 rollouts: the engine's FP8 layers and the pushed tensors follow num_first_layers_in_bf16
    and fp8_module_filter_fn (they used to be everything but lm_head), with power-of-two scales when asked."""
    tokenizer = tiny_char_tokenizer()
    args = FP8GRPOConfig(
        **{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path), use_cpu=True, bf16=False,
        use_vllm=True, vllm_mode="colocate", fp8_recipe=None, rollout_precision="fp8", num_last_layers_in_bf16=1,
        fp8_power_of_two_scales=True,
    )  # fmt: skip
    trainer = FP8GRPOTrainer(tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0),
                             say_letter_reward, args, train_dataset=say_letter_dataset(64), processing_class=tokenizer,
                             fp8_module_filter_fn=lambda mod, fqn: not fqn.endswith("o_proj"))  # fmt: skip
    generation = trainer.vllm_generation
    kept = set(json.loads((generation.engine_dir / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"])  # fmt: skip
    assert kept == {"lm_head", *layer_names(3), *(f"model.layers.{i}.self_attn.o_proj" for i in range(3))}
    generation.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    assert pushed["model.layers.3.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert pushed["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    scale = pushed["model.layers.1.mlp.up_proj.weight_scale_inv"]
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # what the exported checkpoint holds too


def test_dora_rollouts_push_the_weight_peft_merges(fake_vllm, tmp_path):
    import copy

    from peft import LoraConfig

    trainer = _tiny_trainer(
        tmp_path,
        peft_config=LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], use_dora=True, init_lora_weights=False
        ),  # fmt: skip
    )
    trainer.vllm_generation.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    merged = copy.deepcopy(trainer.model).merge_and_unload()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.v_proj"):
        assert_fp8_equal(
            pushed[f"{name}.weight"], pushed[f"{name}.weight_scale_inv"], merged.get_submodule(name).weight
        )
    assert not any("lora" in n or "magnitude" in n for n in pushed)


def test_no_tis_and_no_mismatch_logging_leave_trls_importance_sampling_off(fake_vllm, tmp_path, model_batch):
    """tis='off' + log_rollout_mismatch=False: TRL must never be told to score rollouts (an extra forward per step),
    not even after a loss computation."""
    trainer = _tiny_trainer(tmp_path, tis="off", log_rollout_mismatch=False)
    assert trainer.vllm_importance_sampling_correction is False
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, model_batch)
    assert trainer.vllm_importance_sampling_correction is False


@pytest.fixture
def model_batch(tmp_path):
    """A scored GRPO batch from a trainer without vLLM (the same model and tokenizer as `_tiny_trainer`)."""
    tokenizer = tiny_char_tokenizer()
    args = FP8GRPOConfig(**{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path / "plain"),
                         use_cpu=True, bf16=False)  # fmt: skip
    model = tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    trainer = FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                             processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    return trainer._generate_and_score_completions([trainer.train_dataset[i] for i in (0, 1) for _ in range(8)])


def test_kv_scale_calibration_runs_the_decoder_in_chunks_without_the_lm_head(fake_vllm, tmp_path):
    trainer = _tiny_trainer(tmp_path, fp8_kv_cache=True, per_device_train_batch_size=8, num_generations=8)
    model = trainer.model
    head_calls, decoder_batches = [], []
    model.lm_head.register_forward_hook(lambda *a: head_calls.append(1))
    model.model.register_forward_pre_hook(lambda mod, args, kwargs: decoder_batches.append(kwargs["input_ids"].shape[0]),
                                          with_kwargs=True)  # fmt: skip
    prompts = [[2, 5, 6, 7][: 1 + i % 4] for i in range(20)]
    trainer._calibrate_kv_scales(prompts)
    assert head_calls == [] and decoder_batches == [8, 8, 4]
    scales = trainer.vllm_generation.kv_observer.scales()
    # The same amax as running the whole model chunk by chunk (the head never mattered).
    observer = trainer.vllm_generation.kv_observer
    from trl.trainer.utils import pad

    with torch.no_grad():
        for start in range(0, 20, 8):
            ids = [torch.tensor(p) for p in prompts[start : start + 8]]
            mask = pad([torch.ones_like(t) for t in ids], padding_value=0, padding_side="left")
            model(input_ids=pad(ids, padding_value=0, padding_side="left"), attention_mask=mask)
    assert observer.scales() == scales


def test_unreachable_server_says_how_to_start_one(monkeypatch):
    import trl.generation.vllm_client as trl_client

    if not trl_client.is_requests_available():
        pytest.skip("requests is not installed")
    monkeypatch.setattr(trl_client, "is_vllm_available", lambda *a, **k: True)
    generation = types.SimpleNamespace(
        server_base_url="http://127.0.0.1:9", server_timeout=0.0, model=fp8_model(), rollout_precision="fp8",
        kv_observer=None, fp8_backend="auto",
    )  # fmt: skip
    with pytest.raises(
        ConnectionError,
        match="E8M0=0 VLLM_MOE_USE_DEEP_GEMM=0 trl vllm-serve --model <fp8_dir> --linear-backend deep_gemm",
    ):
        FP8VLLMGeneration._check_server(generation)


def test_rollout_statistics_and_the_capacity_line_reach_the_logs(fake_vllm, tmp_path, capsys):
    """What vLLM's scheduler reports after each engine step (its stat-logger interface) becomes per-rollout metrics;
    after the first rollout one line says how many sequences the KV cache holds, and what BF16 would."""
    from trl_fp8.rollout.stats import RolloutStats

    engine = types.SimpleNamespace(llm_engine=types.SimpleNamespace(logger_manager=types.SimpleNamespace(
        stat_loggers=["vLLM's logging and Prometheus loggers"])))  # fmt: skip
    stats = RolloutStats.attach(engine)
    assert engine.llm_engine.logger_manager.stat_loggers == [stats]
    assert RolloutStats.attach(types.SimpleNamespace(llm_engine=types.SimpleNamespace())) is None  # stats off

    trainer = _tiny_trainer(tmp_path, fp8_kv_cache=True)
    generation = trainer.vllm_generation
    generation.rollout_stats, generation.kv_cache_tokens = stats, 197_984
    for running, waiting, usage, preempted in ((40, 88, 0.5, 0), (85, 43, 0.99, 2), (12, 0, 0.3, 1)):
        stats.record(types.SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage),
                     types.SimpleNamespace(num_preempted_reqs=preempted))  # fmt: skip
    output = {"prompt_mask": torch.ones(16, 10, dtype=torch.long), "prompt_ids": torch.ones(16, 10)}
    trainer._log_rollout_capacity(output, "train")
    metrics = {k: v for k, v in trainer._metrics["train"].items() if k.startswith("vllm/")}
    assert metrics == {"vllm/running_peak": [85.0], "vllm/waiting_peak": [88.0], "vllm/preemptions": [3.0],
                       "vllm/kv_cache_usage_peak": [0.99], "vllm/kv_cache_tokens": [197984.0]}  # fmt: skip
    seq_len = 10 + trainer.max_completion_length
    line = capsys.readouterr().out
    assert (
        f"KV cache 197,984 tokens (FP8 weights + FP8 KV cache): room for {197_984 // seq_len:,} sequences of {seq_len}"
        in line
    )
    assert "a BF16 engine in the same memory would have room for" in line
    trainer._log_rollout_capacity(output, "train")  # the line once; the metrics every rollout, from zero again
    assert capsys.readouterr().out == "" and trainer._metrics["train"]["vllm/running_peak"] == [85.0, 0.0]


def test_the_bf16_equivalent_moves_the_saved_weight_bytes_into_bf16_kv_cache():
    from trl_fp8.rollout.capacity import ModelShape, kv_bytes_per_token, weight_bytes
    from trl_fp8.rollout.stats import capacity_line

    model = tiny_qwen3()
    shape = ModelShape.from_config(model.config)
    tokens = 100_000
    saved = weight_bytes(shape, False) - weight_bytes(shape, True)
    expected = (tokens * kv_bytes_per_token(shape, True) - saved) // kv_bytes_per_token(shape, False) // 100
    line = capacity_line(model, tokens, fp8_weights=True, fp8_kv=True, seq_len=100)
    assert line.endswith(f"would have room for {expected:,}.") and "1,000 sequences of 100 tokens" in line
    assert capacity_line(model, tokens, fp8_weights=False, fp8_kv=False, seq_len=100).endswith("at once.")


def test_a_kv_bound_rollout_without_fp8_kv_cache_is_told_what_fp8_kv_would_hold():
    from trl_fp8.rollout.capacity import ModelShape, kv_bytes_per_token
    from trl_fp8.rollout.stats import capacity_line

    model = tiny_qwen3()
    shape = ModelShape.from_config(model.config)
    tokens = 100_000  # FP8 weights, BF16 KV: the same memory in FP8 KV holds twice the tokens
    fp8_kv_room = tokens * kv_bytes_per_token(shape, False) // kv_bytes_per_token(shape, True) // 100
    bound = capacity_line(model, tokens, fp8_weights=True, fp8_kv=False, seq_len=100, rollout_seqs=1_500)
    assert bound.endswith(f"an FP8 KV cache (fp8_kv_cache=True) would have room for {fp8_kv_room:,}, for a larger "
                          "trainer-vs-rollout mismatch (docs/when-fp8-pays.md).")  # fmt: skip
    assert "The KV cache binds (1,500 sequences per rollout)" in bound and fp8_kv_room == 2_000
    fits = capacity_line(model, tokens, fp8_weights=True, fp8_kv=False, seq_len=100, rollout_seqs=1_000)
    assert "binds" not in fits and "FP8 KV" not in fits  # every sequence fits: nothing to suggest
    already = capacity_line(model, tokens, fp8_weights=True, fp8_kv=True, seq_len=100, rollout_seqs=1_500)
    assert "binds" not in already  # an FP8 KV cache already: nothing to suggest
    bf16 = capacity_line(model, tokens, fp8_weights=False, fp8_kv=False, seq_len=100, rollout_seqs=1_500)
    assert "BF16 engine in the same memory" not in bf16 and "would have room for 2,000" in bf16
