"""Sibling FP8 layers (q/k/v, gate/up) run as one GEMM per pass: the same values per layer as running each alone,
fewer kernels, the same FP8 bytes for vLLM and the checkpoint (CPU, exact FP8 emulation)."""

import copy
import hashlib

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8LinearConfig, convert_to_fp8, save_fp8_checkpoint
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.ops import emulated
from trl_fp8.sibling_gemms import FP8SiblingGroup, group_fp8_siblings, sibling_group_problem
from trl_fp8.vllm_sync import rollout_weight_tensors


def pair(dtype=torch.float32, layers=2):
    """The same tiny Qwen3 twice: each FP8 layer alone, and siblings as one GEMM."""
    base = tiny_qwen3(seed=0, dtype=dtype, num_hidden_layers=layers)
    alone, fused = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(alone, config=FP8LinearConfig())
    convert_to_fp8(fused, config=FP8LinearConfig(fuse_sibling_gemms=True))
    return alone, fused


def forward_backward(model, ids):
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def assert_same_training_math(alone, fused, ids, bound=1e-5):
    """Logits and every gradient within `bound` (relative norm) of the layers run alone. Measured in fp32: logits
    equal, gradients within 2e-6 (summation order, and an FP8 rounding of dy flipped by it now and then)."""
    logits_a, grads_a = forward_backward(alone, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    assert rel(logits_f, logits_a) < bound
    for name, g in grads_a.items():
        assert rel(grads_f[name], g) < bound, name


def test_conversion_groups_qkv_and_gate_up_per_decoder_layer():
    alone, fused = pair()
    for layer in fused.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj._fp8_group[0].members == [attn.q_proj, attn.k_proj, attn.v_proj]
        assert mlp.gate_proj._fp8_group[0].members == [mlp.gate_proj, mlp.up_proj]
        assert attn.o_proj._fp8_group is None and mlp.down_proj._fp8_group is None
    assert all(getattr(m, "_fp8_group", None) is None for m in alone.modules())
    assert group_fp8_siblings(fused) == []  # already grouped: converting again changes nothing


def test_one_gemm_computes_what_each_layer_computes_fp32():
    """fp32 masters: every FP8 operand is the same (blocks and groups never straddle two layers), so outputs agree
    and gradients agree to fp32 summation order."""
    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    assert_same_training_math(alone, fused, ids)


def test_one_gemm_computes_what_each_layer_computes_bf16():
    """BF16 masters: the forward is the same, bit for bit. The stacked DGrad sums q, k and v's contributions to dx in
    one fp32 accumulation, where three layers round each to BF16 and add them in BF16, so gradients move within BF16
    noise (measured: 0-5% apart, each 3-12% from the fp32 model's); the stack must be no less accurate (<= 1.15x the
    error of the layers alone, against the same model in fp32)."""
    alone, fused = pair(torch.bfloat16)
    reference = copy.deepcopy(alone).float()
    ids = torch.randint(0, 200, (2, 24))
    logits_a, grads_a = forward_backward(alone, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    _, grads_ref = forward_backward(reference, ids)
    assert torch.equal(logits_f, logits_a)
    for name, g in grads_ref.items():
        assert rel(grads_f[name], g) <= 1.15 * rel(grads_a[name], g) + 1e-3, name


def count_kernels(monkeypatch):
    counts = dict.fromkeys(("gemm", "quantize_act", "quantize_weight"), 0)
    for name in counts:
        original = getattr(emulated, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(emulated, name, counted)
    return counts


def test_siblings_launch_a_third_of_the_gemms(monkeypatch):
    """Per decoder layer, forward: 7 FProp GEMMs alone, 4 grouped (qkv, o, gate_up, down); backward: 14 GEMMs and 7
    output-gradient quantizations alone, 8 and 4 grouped, and the DGrad weight layout re-quantized only for o and
    down (a group multiplies by the FP8 stack its cache holds)."""
    ids = torch.randint(0, 200, (2, 24))
    measured = {}
    for label, model in zip(("alone", "fused"), pair(), strict=True):
        model(input_ids=ids)  # weights quantized and cached
        counts = count_kernels(monkeypatch)
        logits = model(input_ids=ids).logits
        forward = dict(counts)
        logits.float().pow(2).mean().backward()
        measured[label] = forward, {k: counts[k] - forward[k] for k in counts}
        monkeypatch.undo()
    layers = 2
    assert measured["alone"] == (
        {"gemm": 7 * layers, "quantize_act": 4 * layers, "quantize_weight": 0},
        {"gemm": 14 * layers, "quantize_act": 7 * layers, "quantize_weight": 7 * layers},
    )
    assert measured["fused"] == (
        {"gemm": 4 * layers, "quantize_act": 4 * layers, "quantize_weight": 0},
        {"gemm": 8 * layers, "quantize_act": 4 * layers, "quantize_weight": 2 * layers},
    )


def checkpoint_digest(model, path):
    save_fp8_checkpoint(model, path, progress=False)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_vllm_sync_and_checkpoint_hold_the_same_bytes(tmp_path):
    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    forward_backward(alone, ids), forward_backward(fused, ids)  # the fused layers' caches now view the stacks
    assert isinstance(fused.model.layers[0].self_attn.k_proj._fp8_weight_cache[1].q._base, torch.Tensor)
    pushed_alone = dict(rollout_weight_tensors(alone, "fp8"))
    pushed_fused = dict(rollout_weight_tensors(fused, "fp8"))
    assert pushed_alone.keys() == pushed_fused.keys()
    for name, t in pushed_alone.items():
        u = pushed_fused[name]
        assert t.dtype == u.dtype and torch.equal(
            t.contiguous().view(torch.uint8), u.contiguous().view(torch.uint8)
        ), name
    assert checkpoint_digest(fused, tmp_path / "fused") == checkpoint_digest(alone, tmp_path / "alone")


def test_optimizer_steps_refresh_the_stacked_weight():
    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (alone, fused)]  # (Adam would amplify noise)
    for _ in range(3):
        for model, opt in zip((alone, fused), opts, strict=True):
            opt.zero_grad()
            forward_backward(model, ids)
            opt.step()
    for (name, p), q in zip(alone.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    for module in fused.modules():
        if hasattr(module, "quantized_weight"):
            from trl_fp8 import quantize_blocks

            q, s = module.quantized_weight()
            q_ref, s_ref = quantize_blocks(module.weight.detach())
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_a_member_called_alone_twice_or_on_another_input_runs_alone():
    alone, fused = pair()
    attn_a, attn_f = alone.model.layers[0].self_attn, fused.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 256), torch.randn(2, 5, 256)
    assert torch.equal(attn_f.k_proj(x), attn_a.k_proj(x))  # first caller: computes all three, returns k
    assert torch.equal(attn_f.k_proj(x), attn_a.k_proj(x))  # again on the same input: runs alone
    assert torch.equal(attn_f.q_proj(x), attn_a.q_proj(x))  # the pending q
    assert torch.equal(attn_f.v_proj(y), attn_a.v_proj(y))  # another input: a new stack computed for y
    assert torch.equal(attn_f.v_proj(x), attn_a.v_proj(x))
    x.add_(1.0)  # an in-place change: nothing computed before it is handed out
    assert torch.equal(attn_f.q_proj(x), attn_a.q_proj(x))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_scoring_passes_without_autograd(mode):
    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        a, f = alone(input_ids=ids).logits, fused(input_ids=ids).logits
    torch.testing.assert_close(f, a, rtol=1e-5, atol=1e-5)
    assert_same_training_math(alone, fused, ids)  # the cache made under inference mode is not reused


def test_gradient_checkpointing_recomputes_the_same_group():
    alone, fused = pair()
    for model in (alone, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    assert_same_training_math(alone, fused, torch.randint(0, 200, (2, 24)))


def test_lora_adapters_on_grouped_base_layers():
    from peft import LoraConfig, get_peft_model

    models = []
    for model in pair():
        torch.manual_seed(1)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
        models.append(get_peft_model(model, config))
    alone, fused = models
    assert group_fp8_siblings(fused) == []
    assert_same_training_math(alone, fused, torch.randint(0, 200, (2, 24)))
    assert any("lora_A" in n and p.grad is not None for n, p in fused.named_parameters())


def test_deep_copy_gets_its_own_group():
    _, fused = pair()
    clone = copy.deepcopy(fused)
    group = clone.model.layers[1].mlp.gate_proj._fp8_group[0]
    assert group.members == [clone.model.layers[1].mlp.gate_proj, clone.model.layers[1].mlp.up_proj]
    ids = torch.randint(0, 200, (2, 24))
    torch.testing.assert_close(clone(input_ids=ids).logits, fused(input_ids=ids).logits)


def test_unfit_groups_are_refused_by_name():
    _, fused = pair()
    layer = fused.model.layers[0]
    assert sibling_group_problem([layer.self_attn.o_proj]) == "fewer than two layers"
    assert sibling_group_problem([layer.self_attn.o_proj, layer.mlp.down_proj]) == (
        "the layers have different input dims"
    )
    with pytest.raises(ValueError, match="already belongs to a sibling group"):
        FP8SiblingGroup([layer.self_attn.q_proj, layer.self_attn.o_proj])
    with pytest.raises(ValueError, match="fuse_sibling_gemms applies to the blockwise recipe only"):
        FP8LinearConfig(recipe="tensorwise", fuse_sibling_gemms=True)
    with pytest.raises(ValueError, match="fp8_recipe=None trains in BF16"):
        FP8GRPOConfig(output_dir="unused", fp8_recipe=None, fp8_fuse_sibling_gemms=True)


def test_a_dropped_layer_stack_frees_without_the_garbage_collector():
    """Members and group refer to each other; the group's references are weak, so dropping the layers frees them at
    once (a reference cycle would hold a dropped model's GPU memory until the collector runs), and a pickled model
    gets its groups back."""
    import gc
    import io
    import weakref

    from torch import nn

    from trl_fp8 import FP8Linear

    def stack():
        attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, FP8Linear.convert_(nn.Linear(128, 128, bias=False), FP8LinearConfig()))
        assert len(group_fp8_siblings(attn)) == 1
        return attn

    gc.disable()
    try:
        attn = stack()
        layer = weakref.ref(attn.q_proj)
        del attn
        assert layer() is None
    finally:
        gc.enable()
    attn = stack()
    buffer = io.BytesIO()
    torch.save(attn, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.k_proj._fp8_group[0].members == [loaded.q_proj, loaded.k_proj, loaded.v_proj]
