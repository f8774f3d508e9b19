"""Options of the FP8 layers that a combination would ignore are refused when the configuration is built, naming the
fix (`FP8GRPOConfig`, `FP8LinearConfig`, `compile_decoder_layers`); the combinations accepted do what they say."""

import re

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8LinearConfig, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.trainer.regional_compile import compile_decoder_layers


def grpo_config(**settings) -> FP8GRPOConfig:
    return FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **settings)


@pytest.mark.parametrize(
    "settings, fix",
    [
        ({"fp8_recipe": None, "fp8_experts_gemm": "triton"}, "Drop fp8_experts_gemm, or train in FP8"),
        ({"fp8_recipe": "tensorwise", "fp8_experts_gemm": "deepgemm"}, "Drop fp8_experts_gemm, or use fp8_recipe="),
        ({"fp8_recipe": "tensorwise", "fp8_cache_weights": False}, "Drop fp8_cache_weights, or use fp8_recipe="),
        ({"fp8_recipe": "rowwise", "fp8_cache_weights": True}, "Drop fp8_cache_weights, or use fp8_recipe="),
        ({"fp8_keep_experts_in_bf16": True, "fp8_experts_gemm": "triton"}, "keeps the experts in BF16. Drop"),
        ({"fp8_backend": "emulated", "fp8_experts_gemm": "deepgemm"}, "one expert at a time in the emulation"),
        ({"compile_decoder_layers": True, "fp8_fuse_swiglu": True}, "or set compile_decoder_layers=False"),
        ({"compile_decoder_layers": True, "fp8_fuse_sibling_gemms": True}, "or set compile_decoder_layers=False"),
    ],
)
def test_grpo_config_refuses_fp8_options_without_effect(settings, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        grpo_config(**settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"fp8_recipe": "tensorwise"},
        {"fp8_experts_gemm": "triton"},
        {"fp8_cache_weights": False},
        {"compile_decoder_layers": True},
        {"fp8_fuse_sibling_gemms": True, "fp8_fuse_swiglu": True},
    ],
)
def test_grpo_config_accepts_fp8_options_that_act(settings):
    grpo_config(**settings)


@pytest.mark.parametrize(
    "settings, fix",
    [
        ({"recipe": "tensorwise", "experts_gemm": "deepgemm"}, "Drop experts_gemm, or use recipe='blockwise'"),
        ({"recipe": "rowwise", "cache_quantized_weight": False}, "Drop cache_quantized_weight, or use recipe="),
        ({"backend": "emulated", "experts_gemm": "triton"}, "Drop experts_gemm, or use backend='auto'"),
    ],
)
def test_layer_config_refuses_options_without_effect(settings, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        FP8LinearConfig(**settings)


@pytest.mark.parametrize("fusion", ["fuse_sibling_gemms", "fuse_swiglu"])
def test_compiling_layers_with_eager_only_fusions_is_refused(fusion):
    """Inside a compiled region the fused paths step aside and the layers run unfused: refused, naming the fusion."""
    model = tiny_qwen3(num_hidden_layers=2)
    convert_to_fp8(model, config=FP8LinearConfig(**{fusion: True}))
    with pytest.raises(ValueError, match=f"converted with {fusion}.*Convert without them"):
        compile_decoder_layers(model)
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


def test_compiling_unfused_fp8_layers_is_accepted():
    model = tiny_qwen3(num_hidden_layers=2)
    convert_to_fp8(model, config=FP8LinearConfig())
    assert compile_decoder_layers(model, backend="eager") == 2
    torch._dynamo.reset()
