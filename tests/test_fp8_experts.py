"""Mixture-of-experts layers in FP8 (`trl_fp8.nn.experts`), on tiny transformers MoE models, CPU emulation.

Two references, as for the dense layer (`test_fp8_linear.py`):
- the exact one: every expert's tokens through the dense FP8 layer (`FP8Linear`, the same quantizers and emulated
  GEMMs) with that expert's weights; FP8 experts must equal it bit for bit in the forward and the weight gradients,
  and up to fp32 summation order in the input gradient (contributions of a token's k experts add in another order);
- the unquantized float64 computation bounds the total FP8 error: measured 0.062-0.065 relative for the two chained
  FP8 GEMMs with the gate between them (one dense layer: 0.034-0.038; sqrt(2 x 0.035^2 + 0.035^2) ~ 0.061); bound 0.1.
"""

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from trl_fp8 import FP8Linear, FP8LinearConfig, convert_to_fp8, save_fp8_checkpoint
from trl_fp8.nn.experts import FP8Experts

from conftest import assert_fp8_equal, rel_err

H, INTER, E, K = 256, 128, 4, 2  # hidden, expert intermediate, experts, experts per token


def tiny_moe(**kwargs):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = dict(vocab_size=128, hidden_size=H, intermediate_size=512, moe_intermediate_size=INTER, num_experts=E,
                  num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=128, mlp_only_layers=[1])  # fmt: skip
    config.update(kwargs)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))


def experts_and_routing(tokens=40, skip_expert=2):
    """A converted experts layer, its high-precision copy, and a routing with uneven counts and an empty expert."""
    experts = tiny_moe().model.layers[0].mlp.experts
    with torch.no_grad():  # weights of the scale a trained model has, not the init's
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    reference = copy.deepcopy(experts)
    FP8Experts.convert_(experts, FP8LinearConfig(backend="emulated"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g)
    choices = [e for e in range(E) if e != skip_expert]
    index = torch.stack([torch.randperm(len(choices), generator=g)[:K] for _ in range(tokens)])
    index = torch.tensor(choices)[index]
    index[:25, 0] = 0  # expert 0 gets many more tokens than the others
    index[:25, 1] = torch.where(index[:25, 1] == 0, torch.tensor(choices[1]), index[:25, 1])
    weights = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)
    return experts, reference, x, index, weights


def per_expert_fp8_reference(reference, x, index, weights):
    """Each expert's tokens through `FP8Linear` layers holding that expert's weights; the k outputs of a token summed
    in fp32 in slot order, as the FP8 experts do."""
    out = torch.zeros(x.shape[0], K, H)
    linears = []
    for e in range(E):
        up = FP8Linear.convert_(nn.Linear(H, 2 * INTER, bias=False), FP8LinearConfig(backend="emulated"))
        down = FP8Linear.convert_(nn.Linear(INTER, H, bias=False), FP8LinearConfig(backend="emulated"))
        up.weight, down.weight = nn.Parameter(reference.gate_up_proj[e]), nn.Parameter(reference.down_proj[e])
        linears.append((up, down))
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    for e, (up, down) in enumerate(linears):
        pairs = order[flat[order] == e]  # this expert's (token, slot) pairs, in token order
        if len(pairs) == 0:
            continue
        gate, upv = up(x[pairs // K]).chunk(2, dim=-1)
        y = down(reference.act_fn(gate) * upv) * weights.reshape(-1)[pairs, None]
        out[pairs // K, pairs % K] = y
    return out.sum(dim=1, dtype=torch.float32), linears


def test_fp8_experts_equal_the_dense_fp8_math_applied_to_each_experts_tokens():
    experts, reference, x, index, weights = experts_and_routing()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = experts(x1, index, weights)
    ref, linears = per_expert_fp8_reference(reference, x2, index, weights)
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for e, (up, down) in enumerate(linears):
        assert torch.equal(
            experts.gate_up_proj.grad[e], up.weight.grad if up.weight.grad is not None else 0 * up.weight
        )
        assert torch.equal(
            experts.down_proj.grad[e], down.weight.grad if down.weight.grad is not None else 0 * down.weight
        )
    assert rel_err(x1.grad, x2.grad) < 1e-6
    assert not experts.gate_up_proj.grad[2].any()  # expert 2 received no token: no gradient, no error


def test_expert_counts_equal_bincount_with_empty_experts_and_any_id_dtype():
    """The routed rows per expert, counted without a host sync (`nn.experts.expert_counts`), are `torch.bincount`'s,
    including experts no token chose and ids that are not int64."""
    from trl_fp8.nn.experts import expert_counts

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (300,), generator=g)  # experts 6 and 7 of 8 get no row
    for dtype in (torch.int64, torch.int32):
        counts = expert_counts(ids.to(dtype), 8)
        assert counts.dtype == torch.int64 and torch.equal(counts, torch.bincount(ids, minlength=8))
    assert torch.equal(expert_counts(ids[:0], 8), torch.zeros(8, dtype=torch.int64))


def test_fp8_experts_total_error_against_the_unquantized_computation():
    experts, reference, x, index, weights = experts_and_routing(tokens=256)
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    out = experts(x1, index, weights)
    reference.double()
    reference.config._experts_implementation = "eager"
    ref = reference(x2, index, weights.double())
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    errs = [rel_err(out, ref), rel_err(x1.grad, x2.grad)]
    errs += [rel_err(getattr(experts, w).grad, getattr(reference, w).grad) for w in ("gate_up_proj", "down_proj")]
    assert all(0.03 < e < 0.1 for e in errs), errs  # FP8 rounding shows, and stays bounded


def test_conversion_names_the_router_and_refuses_layouts_it_cannot_run():
    model = tiny_moe()
    report = convert_to_fp8(model)
    assert report.experts == ["model.layers.0.mlp.experts"] and report.num_experts == E
    assert isinstance(model.model.layers[0].mlp.experts, FP8Experts)
    assert report.high_precision_params["model.layers.0.mlp.gate.weight"] == "router"
    assert (
        "1 expert layers (4 experts)" in report.summary()
        and "(router): model.layers.0.mlp.gate.weight" in report.summary()
    )
    # Every parameter is either an FP8 layer's weight or listed with its reason.
    fp8 = {f"{n}.weight" for n in report.converted if n not in report.experts}
    fp8 |= {f"model.layers.0.mlp.experts.{w}" for w in ("gate_up_proj", "down_proj")}
    assert {n for n, _ in model.named_parameters()} == fp8 | set(report.high_precision_params)

    biased = tiny_moe().model.layers[0].mlp.experts
    biased.has_bias = True
    with pytest.raises(ValueError, match="has_bias=True.*keep_experts_in_bf16=True"):
        convert_to_fp8(nn.ModuleDict({"experts": biased, "proj": nn.Linear(256, 256)}))
    kept = convert_to_fp8(tiny_moe(), keep_experts_in_bf16=True)
    assert kept.kept["model.layers.0.mlp.experts"] == "keep_experts_in_bf16" and not kept.experts
    with pytest.warns(UserWarning, match="experts kept in high precision, dims not multiples of 128"):
        narrow = convert_to_fp8(tiny_moe(moe_intermediate_size=64))
    assert narrow.kept["model.layers.0.mlp.experts"].startswith("dims not multiples of 128")
    with pytest.raises(ValueError, match="FP8 experts need the blockwise recipe"):
        convert_to_fp8(tiny_moe(), recipe="tensorwise")


def test_grpo_trains_a_moe_model_in_fp8_and_syncs_and_saves_its_experts(tmp_path, monkeypatch):
    """FP8GRPOTrainer on a tiny Qwen3-MoE: every expert weight trains in FP8 (the report says so), the rollout sync
    pushes each expert's FP8 blocks under the checkpoint's per-expert names, and the saved model reloads."""
    from transformers import AutoModelForCausalLM

    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
    from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

    tokenizer = tiny_char_tokenizer()
    model = tiny_moe(eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    args = FP8GRPOConfig(**{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path / "out"),
                         max_steps=2, use_cpu=True, bf16=False, disable_tqdm=True, logging_steps=1)  # fmt: skip
    trainer = FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                             processing_class=tokenizer)  # fmt: skip
    assert trainer.fp8_report.experts == ["model.layers.0.mlp.experts"]
    experts = trainer.model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    trainer.train()
    assert not torch.equal(before, experts.gate_up_proj)  # the experts trained (their gradients went through FP8)
    pushed = dict(rollout_weight_tensors(trainer.model, "fp8"))
    q, s = experts.quantized_expert_weight("gate_up_proj")
    up = "model.layers.0.mlp.experts.2.up_proj"
    assert torch.equal(pushed[f"{up}.weight"].view(torch.uint8), q[2, INTER:].view(torch.uint8))
    assert torch.equal(pushed[f"{up}.weight_scale_inv"], s[2, 1:])
    assert pushed["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    trainer.save_model(str(tmp_path / "fp8"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")


def test_lora_on_the_attention_of_a_moe_model_merges_and_exports(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = tiny_moe()
    convert_to_fp8(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    merged = copy.deepcopy(peft_model).merge_and_unload()
    save_fp8_checkpoint(peft_model, tmp_path / "fp8", progress=False)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    q_proj = "model.layers.1.self_attn.q_proj"
    assert_fp8_equal(
        saved[f"{q_proj}.weight"], saved[f"{q_proj}.weight_scale_inv"], merged.get_submodule(q_proj).weight
    )
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in saved and not any("lora" in k for k in saved)


def test_releasing_the_expert_weight_cache_counts_its_bytes_and_requantizes_the_same_bits():
    """`release_fp8_weight_caches` (colocated sleep-mode rollouts) lets go of the cached FP8 experts; the next use
    quantizes the unchanged weights to the same bits."""
    from trl_fp8.nn.linear import release_fp8_weight_caches

    experts, _reference, x, index, weights = experts_and_routing()
    with torch.no_grad():
        experts(x, index, weights)
    before = {name: experts.quantized_expert_weight(name) for name in ("gate_up_proj", "down_proj")}
    numel = experts.gate_up_proj.numel() + experts.down_proj.numel()
    assert release_fp8_weight_caches(nn.Sequential(experts)) == numel + 4 * numel // 128**2
    assert experts._fp8_weight_cache == {} and release_fp8_weight_caches(experts) == 0
    for name, (q, s) in before.items():
        q2, s2 = experts.quantized_expert_weight(name)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
