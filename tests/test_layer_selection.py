"""`LayerSelection`: the layer choices of a conversion as one frozen object, the same plan as the loose options."""

import dataclasses

import pytest
import torch

from trl_fp8 import convert_to_fp8
from trl_fp8.config import BLOCK, BLOCKWISE, RECIPES, FP8LinearConfig, LayerSelection
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.conversion import plan_fp8_conversion


def not_down_proj(module, fqn):
    return not fqn.endswith("down_proj")


def test_one_block_size_and_recipe_names():
    assert BLOCK == 128 and FP8LinearConfig().block_size == BLOCK
    assert BLOCKWISE == "blockwise" == FP8LinearConfig().recipe and RECIPES[0] == BLOCKWISE


def test_selection_is_frozen_and_hashable():
    selection = LayerSelection(num_first_layers_in_bf16=1, module_filter_fn=not_down_proj)
    with pytest.raises(dataclasses.FrozenInstanceError):
        selection.num_first_layers_in_bf16 = 2
    assert hash(selection) == hash(LayerSelection(num_first_layers_in_bf16=1, module_filter_fn=not_down_proj))


@pytest.mark.parametrize("field", ["num_first_layers_in_bf16", "num_last_layers_in_bf16"])
def test_layer_counts_must_be_non_negative_ints(field):
    with pytest.raises(ValueError, match=f"{field}=-1 .*>= 0"):
        LayerSelection(**{field: -1})
    for bad in (1.0, "1", True, None):
        with pytest.raises(TypeError, match=field):
            LayerSelection(**{field: bad})


def test_filter_must_be_callable():
    with pytest.raises(TypeError, match="module_filter_fn"):
        LayerSelection(module_filter_fn="down_proj")


@pytest.mark.parametrize("entry", ["convert", "plan"])
def test_selection_plans_what_the_loose_options_plan(entry):
    options = dict(num_first_layers_in_bf16=1, num_last_layers_in_bf16=1, module_filter_fn=not_down_proj)
    if entry == "convert":
        loose = convert_to_fp8(tiny_qwen3(), **options)
        together = convert_to_fp8(tiny_qwen3(), selection=LayerSelection(**options))
    else:
        loose, _ = plan_fp8_conversion(tiny_qwen3(), **options)
        together, _ = plan_fp8_conversion(tiny_qwen3(), selection=LayerSelection(**options))
    assert loose == together
    assert together.kept["model.layers.0.self_attn.q_proj"] == "first/last layers in bf16"
    assert together.kept["model.layers.1.mlp.down_proj"] == "module_filter_fn"


def test_positional_options_of_convert_to_fp8_still_work():
    report = convert_to_fp8(tiny_qwen3(), BLOCKWISE, 1, 0, not_down_proj)
    assert report.kept["model.layers.0.mlp.up_proj"] == "first/last layers in bf16"
    assert report.kept["model.layers.2.mlp.down_proj"] == "module_filter_fn"


def test_options_given_twice_raise():
    selection = LayerSelection(num_first_layers_in_bf16=1)
    with pytest.raises(ValueError, match="given twice.*num_last_layers_in_bf16"):
        convert_to_fp8(tiny_qwen3(), num_last_layers_in_bf16=1, selection=selection)
    with pytest.raises(ValueError, match="given twice.*keep_experts_in_bf16"):
        plan_fp8_conversion(tiny_qwen3(), keep_experts_in_bf16=True, selection=selection)
    with pytest.raises(TypeError, match="LayerSelection"):
        plan_fp8_conversion(tiny_qwen3(), selection={"num_first_layers_in_bf16": 1})
    with pytest.raises(TypeError):
        plan_fp8_conversion(tiny_qwen3(), num_middle_layers_in_bf16=1)


def test_keeping_every_layer_still_raises():
    with pytest.raises(ValueError, match="keeps all 4 decoder layers"):
        convert_to_fp8(tiny_qwen3(), selection=LayerSelection(num_first_layers_in_bf16=2, num_last_layers_in_bf16=2))


def test_keep_experts_in_bf16_through_the_selection():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=128, mlp_only_layers=[1])
    )  # fmt: skip
    report, _ = plan_fp8_conversion(model, selection=LayerSelection(keep_experts_in_bf16=True), warn=False)
    assert report.kept["model.layers.0.mlp.experts"] == "keep_experts_in_bf16" and not report.experts
