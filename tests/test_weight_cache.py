"""The FP8 weight cache `FP8Linear` and `FP8Experts` share (`nn.weight_cache`): found by type, counted, released and
invalidated alike, and still importable from `nn.linear`."""

import torch
from torch import nn

from trl_fp8 import FP8Experts, FP8Linear, convert_to_fp8
from trl_fp8.nn import linear
from trl_fp8.nn.weight_cache import (
    FP8WeightCacheMixin,
    cached_fp8_layers,
    fp8_weight_cache_bytes,
    invalidate_fp8_weights,
    optimizer_steps,
    release_fp8_weight_caches,
)


def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=128, mlp_only_layers=[1])
    )  # fmt: skip


def test_old_import_places_still_work():
    assert linear.invalidate_fp8_weights is invalidate_fp8_weights
    assert linear.release_fp8_weight_caches is release_fp8_weight_caches
    assert linear.fp8_weight_cache_bytes is fp8_weight_cache_bytes
    assert linear.cached_fp8_layers is cached_fp8_layers
    assert callable(linear.tensor_bytes)


def test_both_fp8_layers_are_found_by_type():
    model = tiny_moe()
    convert_to_fp8(model)
    layers = cached_fp8_layers(model)
    assert layers and all(isinstance(m, FP8WeightCacheMixin) for m in layers)
    assert any(isinstance(m, FP8Experts) for m in layers) and any(isinstance(m, FP8Linear) for m in layers)
    assert {id(m) for m in layers} == {id(m) for m in model.modules() if isinstance(m, FP8Linear | FP8Experts)}
    # an object that merely looks like one (an attribute and a method) is not a cache
    impostor = nn.Linear(4, 4)
    impostor.fp8_config, impostor.invalidate = None, lambda: None
    assert cached_fp8_layers(nn.Sequential(impostor)) == []


def test_count_release_and_invalidate_alike():
    model = tiny_moe()
    convert_to_fp8(model)
    assert fp8_weight_cache_bytes(model) == 0
    model(input_ids=torch.randint(0, 128, (1, 8)))
    held = fp8_weight_cache_bytes(model)
    layers = cached_fp8_layers(model)
    assert held == sum(layer.cache_bytes() for layer in layers) > 0
    assert release_fp8_weight_caches(model) == held and fp8_weight_cache_bytes(model) == 0
    counts = [layer._fp8_invalidations for layer in layers]
    assert release_fp8_weight_caches(model) == 0 and [layer._fp8_invalidations for layer in layers] == counts
    model(input_ids=torch.randint(0, 128, (1, 8)))
    assert invalidate_fp8_weights(model) == len(layers) and fp8_weight_cache_bytes(model) == 0
    assert [layer._fp8_invalidations for layer in layers] == [c + 1 for c in counts]


def test_load_state_dict_invalidates_experts_and_linears():
    model = tiny_moe()
    convert_to_fp8(model)
    layers = cached_fp8_layers(model)
    counts = [layer._fp8_invalidations for layer in layers]
    model.load_state_dict(model.state_dict())
    assert [layer._fp8_invalidations for layer in layers] == [c + 1 for c in counts]


def test_optimizer_steps_are_counted():
    before = optimizer_steps()
    p = nn.Parameter(torch.zeros(1))
    torch.optim.SGD([p], lr=0.1).step()
    assert optimizer_steps() == before + 1
