"""PEFT adapters in the exported checkpoint and the vLLM sync: every weight adapter type comes out exactly as PEFT's own
`merge_and_unload()` makes it (then FP8-quantized by our quantizer where the layer is FP8), the live model is left as
it was, and adapters that cannot be merged are refused with their type named."""

import copy

import pytest
import torch
from peft import (
    HRAConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    OFTConfig,
    PromptTuningConfig,
    VeraConfig,
    get_peft_model,
)
from safetensors.torch import load_file

from trl_fp8 import FP8Linear, convert_to_fp8, save_fp8_checkpoint
from trl_fp8.checkpoint.save import fp8_checkpoint_tensors
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.adapters import AdapterMergeError, merged_base_parameters, tuner_layer_names
from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

from conftest import assert_fp8_equal, rel_err

TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "lora": lambda: LoraConfig(r=8, target_modules=TARGETS),
    "dora": lambda: LoraConfig(r=8, target_modules=TARGETS, use_dora=True),
    "lora_bias": lambda: LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj"], lora_bias=True),
    "loha": lambda: LoHaConfig(r=8, target_modules=TARGETS),
    "lokr": lambda: LoKrConfig(r=8, target_modules=TARGETS),
    "ia3": lambda: IA3Config(target_modules=TARGETS, feedforward_modules=["down_proj"]),
    "vera": lambda: VeraConfig(r=8, target_modules=["q_proj", "up_proj"]),
    "oft": lambda: OFTConfig(r=0, oft_block_size=32, target_modules=["q_proj", "up_proj"]),
    "hra": lambda: HRAConfig(r=8, target_modules=["q_proj", "up_proj"]),
}


def adapted(kind: str, fp8: bool):
    """A tiny Qwen3 (q/k/v biases, so bias-merging adapters show) with a trained-looking adapter of `kind`."""
    model = tiny_qwen3(vocab_size=128, attention_bias=True)
    if fp8:
        convert_to_fp8(model)
    model = get_peft_model(model, ADAPTERS[kind]())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # the adapter: away from its (often identity) initialisation
                p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind", ADAPTERS)
def test_every_weight_adapter_merges_exactly_as_peft_merges_it(kind):
    model = adapted(kind, fp8=False)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exported = dict(fp8_checkpoint_tensors(model, fp8_modules=set()))
    assert set(exported) == set(reference)  # no adapter tensors (lora_A, ia3_l, hada_w1_a, ...), plain names
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing merged into the model
    assert not any(layer.merged for layer in dict(model.named_modules()).values() if hasattr(layer, "merged"))


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "ia3"])
def test_fp8_layers_with_adapters_export_and_sync_the_quantized_merged_weight(kind, tmp_path):
    model = adapted(kind, fp8=True)
    base = model.get_base_model()
    layers = [m for m in base.modules() if isinstance(m, FP8Linear)]
    for layer in layers:
        layer.quantized_weight()  # fill the FP8 weight caches
    invalidations = [layer._fp8_invalidations for layer in layers]
    merged = copy.deepcopy(model).merge_and_unload()
    pushed = dict(rollout_weight_tensors(model, "fp8"))
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.2.mlp.down_proj"):
        weight = merged.get_submodule(name).weight
        assert_fp8_equal(pushed[f"{name}.weight"], pushed[f"{name}.weight_scale_inv"], weight)
    assert [layer._fp8_invalidations for layer in layers] == invalidations  # the live caches stay valid

    save_fp8_checkpoint(model, tmp_path / "fp8", progress=False)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    assert set(saved) == set(pushed) and not any("lora" in k or "ia3" in k or "hada" in k for k in saved)
    assert not list((tmp_path / "fp8").glob("adapter_*"))
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 84, (2, 16))
    with torch.no_grad():
        err = rel_err(AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").float()(ids).logits, merged(ids).logits)
    assert err < 0.12, err  # FP8 weights and BF16 norms against the FP32 merged model (same bound as plain export)


def test_adapters_that_change_the_input_are_refused_with_their_type(tmp_path):
    model = get_peft_model(tiny_qwen3(vocab_size=128), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(AdapterMergeError, match="PROMPT_TUNING.*cannot be merged"):
        save_fp8_checkpoint(model, tmp_path / "out", progress=False)
    with pytest.raises(AdapterMergeError, match="PROMPT_TUNING"):
        list(rollout_weight_tensors(model, "fp8"))
    assert not (tmp_path / "out").exists()


def test_a_tuner_peft_cannot_merge_is_refused_with_its_type(monkeypatch):
    model = adapted("lora", fp8=False)
    layer = dict(model.get_base_model().named_modules())[tuner_layer_names(model.get_base_model())[0]]

    def cannot(*args, **kwargs):
        raise NotImplementedError("no merge for this layer")

    monkeypatch.setattr(type(layer), "merge", cannot)
    with pytest.raises(AdapterMergeError, match="cannot merge the Linear adapter.*no merge for this layer"):
        merged_base_parameters(layer)
