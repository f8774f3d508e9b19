"""The gated MLP's activation fused into down_proj's input quantization: the unfused FP8 path's values bit for bit,
one quantization pass less, one BF16 tensor less saved for backward (CPU, exact FP8 emulation)."""

import copy

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8LinearConfig, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.fused_swiglu import fuse_swiglu, swiglu_problem
from trl_fp8.ops import emulated


def pair(dtype=torch.bfloat16, **fusions):
    base = tiny_qwen3(seed=0, dtype=dtype, num_hidden_layers=2)
    plain, fused = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(plain, config=FP8LinearConfig())
    convert_to_fp8(fused, config=FP8LinearConfig(fuse_swiglu=True, **fusions))
    return plain, fused


def forward_backward(model, ids):
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("siblings", [False, True], ids=["gate_up_alone", "gate_up_one_gemm"])
def test_fused_mlp_computes_the_unfused_fp8_values_bit_for_bit(dtype, siblings):
    """The product is formed with eager's roundings, and backward runs the ops autograd runs: with the same FP8
    operands, nothing differs (with gate/up as one GEMM, against the same grouping unfused)."""
    plain, fused = pair(dtype, fuse_sibling_gemms=siblings)
    if siblings:
        plain = copy.deepcopy(fused)
        for layer in plain.model.layers:
            del layer.mlp.forward  # back to the model's own MLP forward, gate/up still one GEMM
    assert all("forward" in layer.mlp.__dict__ for layer in fused.model.layers)
    ids = torch.randint(0, 200, (2, 24))
    logits_p, grads_p = forward_backward(plain, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    assert torch.equal(logits_f, logits_p)
    assert grads_f.keys() == grads_p.keys()
    for name, g in grads_p.items():
        assert torch.equal(grads_f[name], g), name


def test_one_quantization_pass_and_one_saved_tensor_less_per_mlp(monkeypatch):
    ids = torch.randint(0, 200, (2, 24))
    seen = {}
    for label, model in zip(("plain", "fused"), pair(), strict=True):
        model(input_ids=ids)  # weights quantized and cached
        calls = {"quantize_act": 0, "quantize_swiglu": 0}
        for fn in calls:
            original = getattr(emulated, fn)

            def counted(*args, _fn=fn, _original=original, _calls=calls, **kwargs):
                _calls[_fn] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(emulated, fn, counted)
        saved_bytes = [0]

        def pack(t, _saved=saved_bytes):
            _saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model.layers[0].mlp(torch.randn(2, 24, 256, dtype=torch.bfloat16))
        seen[label] = dict(calls), saved_bytes[0]
        monkeypatch.undo()
    tokens, inter = 2 * 24, 512
    assert seen["plain"][0] == {"quantize_act": 2, "quantize_swiglu": 0}  # x for gate/up (shared), h for down
    assert seen["fused"][0] == {"quantize_act": 1, "quantize_swiglu": 1}
    # silu(gate) is recomputed in backward instead of kept: one [tokens, intermediate] BF16 tensor less
    assert seen["plain"][1] - seen["fused"][1] == tokens * inter * 2


def test_down_proj_hooks_and_adapters_take_the_eager_path():
    plain, fused = pair()
    x = torch.randn(2, 24, 256, dtype=torch.bfloat16)
    seen = []
    handle = fused.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    out = fused.model.layers[0].mlp(x)
    handle.remove()
    assert len(seen) == 1 and seen[0].shape == (2, 24, 512)  # the hook saw the product
    assert torch.equal(out, plain.model.layers[0].mlp(x))

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lora_p = get_peft_model(plain, LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    torch.manual_seed(1)
    lora_f = get_peft_model(fused, LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    ids = torch.randint(0, 200, (2, 24))
    logits_p, grads_p = forward_backward(lora_p, ids)
    logits_f, grads_f = forward_backward(lora_f, ids)
    assert torch.equal(logits_f, logits_p) and all(torch.equal(grads_f[n], g) for n, g in grads_p.items())


def test_which_mlps_fuse():
    plain, fused = pair()
    mlp = plain.model.layers[0].mlp
    assert swiglu_problem(mlp) is None
    assert swiglu_problem(fused.model.layers[0].mlp) == "its forward is already replaced"
    assert fuse_swiglu(fused) == []
    assert swiglu_problem(plain.model.layers[0].self_attn).startswith("not a gated MLP")
    gelu = copy.deepcopy(mlp)
    gelu.act_fn = torch.nn.GELU()
    assert swiglu_problem(gelu) == "its activation is GELU, not SiLU"
    bf16 = tiny_qwen3(seed=0, dtype=torch.bfloat16, num_hidden_layers=1).model.layers[0].mlp
    assert swiglu_problem(bf16) == "down_proj is not a plain FP8Linear"
    with pytest.raises(ValueError, match="fuse_swiglu applies to the blockwise recipe only"):
        FP8LinearConfig(recipe="rowwise", fuse_swiglu=True)
    with pytest.raises(ValueError, match="fp8_recipe=None trains in BF16"):
        FP8GRPOConfig(output_dir="unused", fp8_recipe=None, fp8_fuse_swiglu=True)
    with pytest.raises(ValueError, match=r"liger_kernel_config=\{'swiglu': False\}"):
        FP8GRPOConfig(output_dir="unused", fp8_fuse_swiglu=True, use_liger_kernel=True)


def test_gradient_checkpointing_recomputes_the_fused_mlp():
    plain, fused = pair(fuse_sibling_gemms=False)
    for model in (plain, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids = torch.randint(0, 200, (2, 24))
    logits_p, grads_p = forward_backward(plain, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    assert torch.equal(logits_f, logits_p) and all(torch.equal(grads_f[n], g) for n, g in grads_p.items())
