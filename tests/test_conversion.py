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
    with pytest.raises(ValueError, match=r"recipe=.mxfp8. is unknown; use one of"):
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


def tiny_experts(**config):
    """A transformers fused-experts module alone (Qwen3-MoE's: gate_up_proj [4, 256, 256], down_proj [4, 256, 128])."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4, **config))
    nn.init.normal_(experts.gate_up_proj, std=0.02)
    nn.init.normal_(experts.down_proj, std=0.02)
    return experts


class StackedLinear(nn.Module):
    """A 3-D weight that is not experts: one linear map per codebook (as Moshi's `FlexibleLinear`)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 256, 256))


def test_convolutions_and_other_3d_weights_are_not_experts():
    """Mamba's, LFM2's and the gated delta net's Conv1d, or any 3-D weight not laid out as experts, stay in high
    precision, named in the report; the model's real experts still convert, and keep_experts_in_bf16 keeps only
    those."""
    from trl_fp8.nn.experts import is_experts_module

    def model():
        return nn.ModuleDict({"conv1d": nn.Conv1d(256, 256, 4, groups=256), "codebooks": StackedLinear(),
                              "experts": tiny_experts(), "proj": nn.Linear(256, 256, bias=False)})  # fmt: skip

    converted = model()
    report = convert_to_fp8(converted)
    assert report.experts == ["experts"] and report.converted == ["proj", "experts"]
    assert report.high_precision_params == {"conv1d.weight": "convolution", "conv1d.bias": "convolution",
                                            "codebooks.weight": "not a linear or expert weight"}  # fmt: skip
    summary = report.summary()
    assert "(convolution): conv1d.weight, conv1d.bias" in summary and "codebooks.weight" in summary
    assert type(converted["conv1d"]) is nn.Conv1d and type(converted["codebooks"]) is StackedLinear
    kept = convert_to_fp8(model(), keep_experts_in_bf16=True)
    assert kept.converted == ["proj"] and kept.kept == {"experts": "keep_experts_in_bf16"}
    assert not is_experts_module(nn.Conv1d(256, 256, 4)) and not is_experts_module(StackedLinear())


def test_experts_are_recognised_by_their_layout():
    """Stacked per-expert weights count as experts by their names or by a `num_experts` the leading dim matches; a
    layout FP8 experts cannot run is refused naming the class and the opt-out."""
    from trl_fp8.nn.experts import is_experts_module

    class ParallelExperts(nn.Module):  # JetMoE's layout: one `weight [E, N, K]` per projection
        def __init__(self):
            super().__init__()
            self.num_experts = 4
            self.weight = nn.Parameter(torch.randn(4, 256, 256))

    assert is_experts_module(tiny_experts()) and is_experts_module(ParallelExperts())
    with pytest.raises(ValueError, match=r"ParallelExperts holds \['weight'\].*keep_experts_in_bf16=True"):
        convert_to_fp8(nn.ModuleDict({"experts": ParallelExperts(), "proj": nn.Linear(256, 256)}))


def test_linear_subclasses_with_their_own_forward_are_kept():
    """An `nn.Linear` subclass computing something else (DeepSeek-V4's grouped output projection) would run plain
    `nn.Linear` math as an FP8Linear: it is kept, with its class named; one without a forward of its own converts."""

    class GroupedLinear(nn.Linear):
        def forward(self, x):  # two groups of 128 inputs, each through half the output rows
            a, b = x.chunk(2, dim=-1)
            w1, w2 = self.weight.chunk(2, dim=0)
            return torch.cat([a @ w1[:, :128].T, b @ w2[:, 128:].T], dim=-1)

    class RenamedLinear(nn.Linear):
        pass

    model = nn.Sequential(GroupedLinear(256, 256, bias=False), RenamedLinear(256, 256), nn.Linear(256, 256))
    x = torch.randn(4, 256)
    expected = model[0](x)
    report = convert_to_fp8(model)
    assert report.kept == {"0": "GroupedLinear has its own forward, not nn.Linear's"}
    assert report.converted == ["1", "2"] and torch.equal(model[0](x), expected)


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=512, max_position_embeddings=64)  # fmt: skip
    return GPTNeoXForCausalLM(config)


def test_the_report_says_what_each_requested_fusion_did():
    """Fused blocks are listed; blocks a fusion skipped are listed with why; one warning names a requested fusion
    that applied nowhere, and none is given when it applied somewhere."""
    both = FP8LinearConfig(fuse_swiglu=True, fuse_sibling_gemms=True)
    model = tiny_qwen3(num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = convert_to_fp8(model, num_first_layers_in_bf16=1, config=both)
        again = convert_to_fp8(model, num_first_layers_in_bf16=1, config=both)  # a no-op, the same report
    assert (again.fused, again.not_fused) == (report.fused, report.not_fused)
    assert report.fused == {"fuse_sibling_gemms": ["model.layers.1.self_attn.q_proj+k_proj+v_proj",
                                                   "model.layers.1.mlp.gate_proj+up_proj"],
                            "fuse_swiglu": ["model.layers.1.mlp"]}  # fmt: skip
    kept = "first/last layers in bf16"
    assert report.not_fused == {
        "fuse_sibling_gemms": {
            "model.layers.0.self_attn.q_proj+k_proj+v_proj": f"kept in high precision: q_proj ({kept}), k_proj "
            f"({kept}), v_proj ({kept})",
            "model.layers.0.mlp.gate_proj+up_proj": f"kept in high precision: gate_proj ({kept}), up_proj ({kept})",
        },
        "fuse_swiglu": {"model.layers.0.mlp": "Qwen3MLP's down_proj is not a blockwise FP8Linear"},
    }
    summary = report.summary()
    assert "fuse_swiglu: 1 fused (model.layers.1.mlp)" in summary
    assert "fuse_swiglu not applied (Qwen3MLP's down_proj is not a blockwise FP8Linear): model.layers.0.mlp" in summary

    with pytest.warns(
        UserWarning, match="fuse_swiglu fused nothing in Qwen3ForCausalLM .*GELUActivation, not SiLU"
    ) as w:
        gelu = convert_to_fp8(tiny_qwen3(num_hidden_layers=2, hidden_act="gelu"), config=both)
    assert len([x for x in w if "fused nothing" in str(x.message)]) == 1
    assert gelu.fused["fuse_swiglu"] == [] and len(gelu.fused["fuse_sibling_gemms"]) == 4
    assert set(gelu.not_fused["fuse_swiglu"].values()) == {"Qwen3MLP's activation is GELUActivation, not SiLU"}

    with pytest.warns(
        UserWarning, match="fuse_sibling_gemms and fuse_swiglu fused nothing in GPTNeoXForCausalLM"
    ) as w:
        neox = convert_to_fp8(gpt_neox(), config=both)
    assert len([x for x in w if "fused nothing" in str(x.message)]) == 1
    # the fix it names is where a trainer takes these options
    assert "FP8Tuning(fuse_sibling_gemms=False, fuse_swiglu=False)" in next(
        str(x.message) for x in w if "fused nothing" in str(x.message))  # fmt: skip
    assert neox.not_fused["fuse_sibling_gemms"]["gpt_neox.layers.0.attention"] == (
        "GPTNeoXAttention has no separate q_proj, k_proj, v_proj (it has query_key_value, dense)")  # fmt: skip
    mlp_reason = neox.not_fused["fuse_swiglu"]["gpt_neox.layers.1.mlp"]
    assert mlp_reason.startswith("GPTNeoXMLP is not a gated MLP") and mlp_reason.endswith("dense_4h_to_h)")
    assert "fuse_sibling_gemms: 0 fused" in neox.summary()
