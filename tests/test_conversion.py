"""convert_to_fp8 on a tiny Qwen3: what is converted, what is kept and why, and that the model still trains."""

import copy
import warnings

import pytest
import torch
from torch import nn

from trl_fp8 import FP8Linear, FP8LinearConfig, convert_to_fp8, fp8_recipe_of, is_fp8_linear
from trl_fp8.demo.tiny_model import tiny_qwen3

from conftest import layer_names, rel_err


def test_converts_every_projection_and_keeps_lm_head():
    model = tiny_qwen3()
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    report = convert_to_fp8(model)
    assert sorted(report.converted) == sorted(n for i in range(4) for n in layer_names(i))
    assert report.kept == {"lm_head": "lm_head"}
    assert report.num_fp8_layers == 28
    assert list(model.state_dict()) == keys  # names unchanged for TRL, PEFT and saving
    assert all(p is params[n] for n, p in model.named_parameters())  # same Parameter objects (optimizer-safe)
    assert isinstance(model.model.layers[0].mlp.up_proj, FP8Linear)
    assert not is_fp8_linear(model.lm_head) and type(model.model.embed_tokens) is nn.Embedding
    assert "28 linear layers converted" in report.summary()


def test_first_and_last_layers_and_filter():
    model = tiny_qwen3()
    report = convert_to_fp8(
        model,
        num_first_layers_in_bf16=1,
        num_last_layers_in_bf16=1,
        module_filter_fn=lambda mod, fqn: not fqn.endswith("down_proj"),
    )
    for i in (0, 3):
        assert all(report.kept[n] == "first/last layers in bf16" for n in layer_names(i))
    assert report.kept["model.layers.1.mlp.down_proj"] == "module_filter_fn"
    assert sorted(report.converted) == sorted(n for i in (1, 2) for n in layer_names(i) if "down" not in n)
    assert not is_fp8_linear(model.model.layers[0].self_attn.q_proj)
    assert is_fp8_linear(model.model.layers[1].self_attn.q_proj)


def test_misfit_dims_are_kept_with_a_warning():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 200), nn.Linear(100, 256))
    with pytest.warns(UserWarning, match="not multiples of 128"):
        report = convert_to_fp8(model)
    assert report.converted == ["0"]
    assert report.kept == {"1": "dims not multiples of 128", "2": "dims not multiples of 128"}


def test_layers_vllm_fuses_are_all_fp8_or_all_kept_with_the_reason():
    """GQA with 64-wide k/v projections (k, v cannot be 128x128-blocked): q is kept with them, since vLLM runs q/k/v
    as one qkv_proj; likewise gate with up when a filter keeps up. Export then works instead of failing after
    training."""
    model = tiny_qwen3(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    with pytest.warns(UserWarning, match="not multiples of 128"):
        report = convert_to_fp8(model, module_filter_fn=lambda mod, fqn: fqn != "model.layers.2.mlp.up_proj")
    for i in range(4):
        assert report.kept[f"model.layers.{i}.self_attn.k_proj"] == "dims not multiples of 128"
        assert report.kept[f"model.layers.{i}.self_attn.q_proj"] == (
            "vLLM fuses it with k_proj (dims not multiples of 128), v_proj (dims not multiples of 128)")  # fmt: skip
        assert f"model.layers.{i}.self_attn.o_proj" in report.converted
    assert report.kept["model.layers.2.mlp.gate_proj"] == "vLLM fuses it with up_proj (module_filter_fn)"
    assert "model.layers.1.mlp.gate_proj" in report.converted
    assert not is_fp8_linear(model.model.layers[0].self_attn.q_proj)
    assert "vLLM fuses it with k_proj" in report.summary()


def test_converting_twice_is_a_noop_and_another_recipe_raises():
    model = tiny_qwen3()
    first = convert_to_fp8(model)
    before = [type(m) for m in model.modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = convert_to_fp8(model)
    assert sorted(second.converted) == sorted(first.converted) and second.kept == first.kept
    assert [type(m) for m in model.modules()] == before
    with pytest.raises(ValueError, match="already FP8 with recipe 'blockwise'"):
        convert_to_fp8(model, recipe="tensorwise")


def test_bad_config_names_the_fix():
    with pytest.raises(ValueError, match="choose one of"):
        FP8LinearConfig(recipe="mxfp8")
    with pytest.raises(ValueError, match="block_size=128"):
        FP8LinearConfig(block_size=64)
    with pytest.raises(ValueError, match=">= 0"):
        convert_to_fp8(tiny_qwen3(num_hidden_layers=1), num_first_layers_in_bf16=-1)


def test_fp8_model_logits_and_training_step():
    """Logits stay close to the high-precision model, and an optimizer step on the FP8 model lowers the loss."""
    torch.manual_seed(0)
    ref = tiny_qwen3()
    model = copy.deepcopy(ref)
    convert_to_fp8(model)
    ids = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    # Measured over seeds 0-3 on this random model: relative logit error 0.088-0.099, per-token KL 3.6e-4 to 5.2e-4
    # (28 FP8 layers, each adding ~3.6% noise to its output); bounds at about 2x, and proof that FP8 is really on.
    assert 0.02 < rel_err(logits, ref_logits) < 0.2
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True)
    assert kl.item() * 256 < 1e-3  # kl_div's "mean" averages over the vocabulary too

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_recipes(recipe):
    model = tiny_qwen3(num_hidden_layers=2)
    keys = list(model.state_dict())
    report = convert_to_fp8(model, recipe=recipe)
    assert report.num_fp8_layers == 14 and fp8_recipe_of(model.model.layers[0].mlp.up_proj) == recipe
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 256, (2, 32))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].mlp.up_proj.weight.grad is not None
    assert convert_to_fp8(model, recipe=recipe).num_fp8_layers == 14  # idempotent here too
