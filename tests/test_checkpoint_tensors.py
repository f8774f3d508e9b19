"""The one per-layer source of checkpoint tensors (`trl_fp8.nn.checkpoint_tensors`): the export and the vLLM sync read
it, so for the same model they carry the same tensors under the same names, bit for bit (dense FP8, FP8 experts, a
BF16-trained model stored in FP8, LoRA on linear layers and on experts), and the in-place expert write reads the same
blocks; `BlockwiseRecipe` rounds scales as the quantizer does."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_fp8_experts import tiny_moe
from test_moe_adapters import EXPERTS, lora_on_fp8_experts

from trl_fp8 import convert_to_fp8, save_fp8_checkpoint
from trl_fp8.checkpoint.experts import fp8_experts_layers, merged_fp8_experts
from trl_fp8.checkpoint.names import checkpoint_names
from trl_fp8.checkpoint.save import fp8_module_names, unwrap_model
from trl_fp8.config import FP8LinearConfig
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.checkpoint_tensors import checkpoint_tensors
from trl_fp8.quantization import quantize_blocks
from trl_fp8.recipe import DEFAULT_RECIPE, BlockwiseRecipe
from trl_fp8.rollout.vllm.engine import rollout_weight_tensors


def dense_fp8():
    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model)
    return model


def dense_fp8_pow2():
    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model, config=FP8LinearConfig(power_of_two_scales=True))
    return model


def experts_fp8():
    model = tiny_moe()
    convert_to_fp8(model)
    return model


def lora_on_fp8_linears():
    model = get_peft_model(dense_fp8(), LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # LoRA's B starts at zero: make the adapter show
                p.add_(0.05 * torch.randn_like(p))
    return model


MODELS = {
    "dense_fp8": dense_fp8,
    "dense_fp8_pow2": dense_fp8_pow2,
    "experts_fp8": experts_fp8,
    "bf16_stored_in_fp8": lambda: tiny_qwen3(vocab_size=128),  # quantized at export and sync (`fp8_modules`)
    "bf16_experts_stored_in_fp8": tiny_moe,
    "lora_on_fp8_linears": lora_on_fp8_linears,
    "lora_on_fp8_experts": lora_on_fp8_experts,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("kind", MODELS)
def test_the_export_and_the_sync_carry_the_same_tensors(kind, pow2, tmp_path):
    model = MODELS[kind]()
    fp8_modules = fp8_module_names(model)
    save_fp8_checkpoint(model, tmp_path, fp8_modules=fp8_modules, power_of_two_scales=pow2, progress=False)
    exported = load_file(tmp_path / "model.safetensors")
    pushed = dict(rollout_weight_tensors(model, "fp8", fp8_modules=fp8_modules, power_of_two_scales=pow2))
    assert set(pushed) == set(exported)
    assert any(t.dtype == torch.float8_e4m3fn for t in pushed.values())
    for name, t in pushed.items():
        assert t.dtype == exported[name].dtype and t.shape == exported[name].shape, name
        assert torch.equal(bits(t.cpu()), bits(exported[name])), name


@pytest.mark.parametrize("kind", ["experts_fp8", "lora_on_fp8_experts"])
def test_the_in_place_expert_write_reads_the_blocks_the_export_splits(kind):
    model = MODELS[kind]()
    pushed = dict(rollout_weight_tensors(model, "fp8"))
    layers = fp8_experts_layers(unwrap_model(model))
    assert set(layers) == {EXPERTS}
    for leaf, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        q, s = merged_fp8_experts(layers[EXPERTS])[leaf]
        for e in range(q.shape[0]):
            for i, part in enumerate(parts):
                rows = slice(i * q.shape[1] // len(parts), (i + 1) * q.shape[1] // len(parts))
                name = f"{EXPERTS}.{e}.{part}.weight"
                assert torch.equal(bits(pushed[name]), bits(q[e, rows])), name
                assert torch.equal(pushed[name + "_scale_inv"], s[e, rows.start // 128 : rows.stop // 128]), name


def test_an_fp8_linear_exports_its_own_quantized_weight_and_keeps_its_scale_rounding():
    model = dense_fp8_pow2()
    layer = model.model.layers[0].self_attn.q_proj
    key = "model.layers.0.self_attn.q_proj.weight"
    names = checkpoint_names(model)
    common = dict(fp8=True, recipe=DEFAULT_RECIPE, names=names, check_finite=True, dtype=torch.bfloat16)
    own = dict(checkpoint_tensors(layer, key, layer.weight, merged=None, **common))
    q, s = layer.quantized_weight()
    assert torch.equal(bits(own[key]), bits(q)) and torch.equal(own[key + "_scale_inv"], s)
    merged = layer.weight.detach() * 1.5  # a weight with adapters merged: the layer's own (power-of-two) rounding
    out = dict(checkpoint_tensors(layer, key, layer.weight, merged=merged, **common))
    q2, s2 = quantize_blocks(merged, power_of_two_scales=True)
    assert torch.equal(bits(out[key]), bits(q2)) and torch.equal(out[key + "_scale_inv"], s2)
    assert torch.equal(torch.log2(s2), torch.log2(s2).round())


def test_the_recipe_quantizes_as_the_quantizer_and_stacks_experts_expert_by_expert():
    torch.manual_seed(0)
    w = torch.randn(2, 256, 128)
    for recipe in (BlockwiseRecipe(), BlockwiseRecipe(power_of_two_scales=True)):
        q, s = recipe.quantize_experts(w)
        for e in range(2):
            qe, se = quantize_blocks(w[e], power_of_two_scales=recipe.power_of_two_scales)
            assert torch.equal(bits(q[e]), bits(qe)) and torch.equal(s[e], se)
    with pytest.raises(AttributeError):
        DEFAULT_RECIPE.power_of_two_scales = True  # frozen: one recipe is shared down the export and sync path
