"""Options of the FP8 layers that a combination would ignore are refused when the configuration is built, naming the
fix (`FP8GRPOConfig`, `FP8Tuning` and its `check` against the config, `FP8LinearConfig`, `compile_decoder_layers`);
the combinations accepted do what they say."""

import re

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8LinearConfig, FP8Tuning, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.trainer.regional_compile import compile_decoder_layers


@pytest.fixture
def liger_installed(monkeypatch):
    """`use_liger_kernel=True` configs build without liger-kernel installed (these tests build no model)."""
    monkeypatch.setattr("trl_fp8.trainer.config.check_liger_installed", lambda: None)


def grpo_config(**settings) -> FP8GRPOConfig:
    return FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **settings)


@pytest.mark.parametrize(
    "settings, tuning, fix",
    [
        ({"fp8_recipe": None}, {"experts_gemm": "triton"}, "Drop experts_gemm, or train in FP8"),
        ({"fp8_recipe": None}, {"fuse_swiglu": True}, "FP8Tuning(fuse_swiglu=True) sets up FP8 training"),
        (
            {"fp8_recipe": "tensorwise"},
            {"experts_gemm": "deepgemm"},
            "Drop FP8Tuning.experts_gemm, or use fp8_recipe=",
        ),
        ({"fp8_recipe": "rowwise"}, {"fuse_sibling_gemms": True}, "Drop FP8Tuning.fuse_sibling_gemms, or use fp8_"),
        ({"fp8_recipe": "tensorwise", "fp8_cache_weights": False}, {}, "Drop fp8_cache_weights, or use fp8_recipe="),
        ({"fp8_recipe": "rowwise", "fp8_cache_weights": True}, {}, "Drop fp8_cache_weights, or use fp8_recipe="),
        ({"fp8_keep_experts_in_bf16": True}, {"experts_gemm": "triton"}, "keeps the experts in BF16. Drop"),
        ({"fp8_backend": "emulated"}, {"experts_gemm": "deepgemm"}, "one expert at a time in the emulation"),
        ({}, {"compile_decoder_layers": True, "fuse_swiglu": True}, "or set compile_decoder_layers=False"),
        ({}, {"compile_decoder_layers": True, "fuse_sibling_gemms": True}, "or set compile_decoder_layers=False"),
        ({"use_liger_kernel": True}, {"fuse_swiglu": True}, "liger_kernel_config={'swiglu': False}, or drop"),
        ({}, {"vllm_deepgemm_workers": 4}, "FP8Tuning(vllm_deepgemm_workers=4) sets up vLLM rollouts"),
        ({}, {"vllm_act_quant_kernel": "vllm"}, "FP8Tuning(vllm_act_quant_kernel='vllm') sets up vLLM rollouts"),
        ({}, {"vllm_norm_quant_kernel": "vllm"}, "FP8Tuning(vllm_norm_quant_kernel='vllm') sets up vLLM rollouts"),
    ],
)
def test_fp8_options_without_effect_are_refused_naming_the_fix(settings, tuning, fix, liger_installed):
    """The config's own options when it is built; a tuning option when the tuning is built (its own rules) or checked
    against the run's config (`FP8Tuning.check`, which the trainer calls before loading the model)."""
    with pytest.raises(ValueError, match=re.escape(fix)):
        FP8Tuning(**tuning).check(grpo_config(**settings))


@pytest.mark.parametrize(
    "tuning, fix",
    [
        ({"experts_gemm": "cuda"}, "FP8Tuning(experts_gemm='cuda') is unknown"),
        ({"vllm_act_quant_kernel": "cuda"}, "FP8Tuning(vllm_act_quant_kernel='cuda') is unknown"),
        ({"vllm_norm_quant_kernel": "cuda"}, "FP8Tuning(vllm_norm_quant_kernel='cuda') is unknown"),
        ({"vllm_deepgemm_workers": -1}, "FP8Tuning(vllm_deepgemm_workers=-1) must be >= 0"),
        ({"fsdp2_prefetch_layers": 0}, "FP8Tuning(fsdp2_prefetch_layers=0): give 1 or more layers"),
    ],
)
def test_tuning_refuses_values_it_does_not_know(tuning, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        FP8Tuning(**tuning)


@pytest.mark.parametrize(
    "settings, tuning",
    [
        ({"fp8_recipe": "tensorwise"}, {}),
        ({}, {"experts_gemm": "triton"}),
        ({"fp8_cache_weights": False}, {}),
        ({}, {"compile_decoder_layers": True}),
        ({}, {"fuse_sibling_gemms": True, "fuse_swiglu": True}),
        ({"use_liger_kernel": True, "liger_kernel_config": {"swiglu": False}}, {"fuse_swiglu": True}),
    ],
)
def test_fp8_options_that_act_are_accepted(settings, tuning, liger_installed):
    FP8Tuning(**tuning).check(grpo_config(**settings))


def test_the_trainer_takes_an_fp8_tuning_only():
    from trl_fp8 import FP8GRPOTrainer

    with pytest.raises(TypeError, match="tuning must be a trl_fp8.FP8Tuning, got dict"):
        FP8GRPOTrainer("unused-model", None, grpo_config(), tuning={"fuse_swiglu": True})


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
