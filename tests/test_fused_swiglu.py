"""The gated MLP's activation fused into down_proj's input quantization: the unfused FP8 path's values bit for bit,
one quantization pass less, one BF16 tensor less saved for backward (CPU, exact FP8 emulation)."""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from trl_fp8 import FP8GRPOConfig, FP8LinearConfig, FP8Tuning, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.fused_swiglu import fuse_swiglu, is_fused_swiglu, swiglu_problem
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
    assert swiglu_problem(fused.model.layers[0].mlp) == "Qwen3MLP is fused already"
    assert fuse_swiglu(fused) == []
    assert swiglu_problem(plain.model.layers[0].self_attn).startswith("Qwen3Attention is not a gated MLP")
    gelu = copy.deepcopy(mlp)
    gelu.act_fn = torch.nn.GELU()
    assert swiglu_problem(gelu) == "Qwen3MLP's activation is GELU, not SiLU"
    bf16 = tiny_qwen3(seed=0, dtype=torch.bfloat16, num_hidden_layers=1).model.layers[0].mlp
    assert swiglu_problem(bf16) == "Qwen3MLP's down_proj is not a blockwise FP8Linear"
    with pytest.raises(ValueError, match="fuse_swiglu applies to the blockwise recipe only"):
        FP8LinearConfig(recipe="rowwise", fuse_swiglu=True)
    with pytest.raises(ValueError, match="fp8_recipe=None trains in BF16"):
        FP8Tuning(fuse_swiglu=True).check(FP8GRPOConfig(output_dir="unused", use_cpu=True, fp8_recipe=None))
    liger = FP8GRPOConfig(output_dir="unused", use_cpu=True)
    liger.use_liger_kernel = True  # (as if liger-kernel were installed: the config checks that it is)
    with pytest.raises(ValueError, match=r"liger_kernel_config=\{'swiglu': False\}"):
        FP8Tuning(fuse_swiglu=True).check(liger)


def test_gradient_checkpointing_recomputes_the_fused_mlp():
    plain, fused = pair(fuse_sibling_gemms=False)
    for model in (plain, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids = torch.randint(0, 200, (2, 24))
    logits_p, grads_p = forward_backward(plain, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    assert torch.equal(logits_f, logits_p) and all(torch.equal(grads_f[n], g) for n, g in grads_p.items())


def mlp_of(module: str, cls: str, config_cls: str, **config):
    """A transformers MLP class built alone from its config (hidden 256, intermediate 512), float32."""
    import importlib

    import transformers

    config = getattr(transformers, config_cls)(hidden_size=256, intermediate_size=512, **config)
    torch.manual_seed(0)
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(config)


@pytest.mark.parametrize(
    "mlp",
    [
        # Falcon-H1 scales the gate's input and down_proj's output
        lambda: mlp_of("falcon_h1", "FalconH1MLP", "FalconH1Config", mlp_multipliers=[0.5, 2.0]),
        # DeepSeek-V4 and GLM-5-Next clamp gate and up (a limit small enough that the clamp changes values)
        lambda: mlp_of("deepseek_v4", "DeepseekV4MLP", "DeepseekV4Config", swiglu_limit=0.05),
        lambda: mlp_of("glm5_next", "Glm5NextTextMLP", "Glm5NextTextConfig", swiglu_limit=0.05),
    ],
    ids=["falcon_h1_multipliers", "deepseek_v4_clamp", "glm5_next_clamp"],
)
def test_mlps_that_compute_more_than_the_plain_product_are_refused_by_name(mlp):
    """Their forward is kept: converted with fuse_swiglu, they compute what the unfused FP8 MLP computes, and the
    report names the class and why."""
    mlp = mlp()
    x = torch.randn(2, 24, 256)
    plain, fused = copy.deepcopy(mlp), copy.deepcopy(mlp)
    convert_to_fp8(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = convert_to_fp8(fused, config=FP8LinearConfig(fuse_swiglu=True))
    assert torch.equal(fused(x), plain(x)) and not torch.equal(plain(x), mlp(x))  # FP8, unfused
    assert not is_fused_swiglu(fused)
    name = type(mlp).__name__
    assert [str(w.message) for w in caught if "fused nothing" in str(w.message)][0].startswith(
        f"fuse_swiglu fused nothing in {name}"
    )
    assert report.not_fused["fuse_swiglu"] == {
        name: f"{name}.forward computes more than down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    }
    assert f"fuse_swiglu not applied ({name}.forward computes more than" in report.summary()


def test_only_the_plain_forward_source_passes():
    """The forward is read, not the class name: the same layers under a forward that adds anything are refused."""

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(256, 512, bias=False), nn.Linear(256, 512, bias=False)
            self.down_proj, self.act_fn = nn.Linear(512, 256, bias=False), nn.SiLU()

        def forward(self, hidden_state):
            """A docstring and another name for the input change nothing."""
            out = self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))
            return out

    class Scaled(Plain):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 2

    class Dropped(Plain):
        def forward(self, x):
            return self.down_proj(nn.functional.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))

    class WithKwargs(Plain):
        def forward(self, x, **kwargs):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    for cls in (Plain, Scaled, Dropped, WithKwargs):
        mlp = cls()
        convert_to_fp8(mlp)
        problem = swiglu_problem(mlp)
        assert (problem is None) == (cls is Plain), (cls, problem)

    class ClampedSiLU(nn.SiLU):
        def forward(self, x):
            return super().forward(x.clamp(-1, 1))

    silu_subclass = Plain()
    silu_subclass.act_fn = ClampedSiLU()
    convert_to_fp8(silu_subclass)
    assert swiglu_problem(silu_subclass) == "Plain's activation is ClampedSiLU, not SiLU"


def test_a_fused_model_pickles_and_still_runs_the_fused_path(monkeypatch):
    """torch.save / torch.load of the whole model (and deepcopy) keep each MLP's fused forward, bound to the loaded
    MLP."""
    _, fused = pair(dtype=torch.float32)
    x = torch.randn(2, 24, 256)
    expected = fused.model.layers[0].mlp(x)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    calls, original = [], emulated.quantize_swiglu
    monkeypatch.setattr(emulated, "quantize_swiglu", lambda *a, **k: calls.append(1) or original(*a, **k))
    for copied in (loaded, copy.deepcopy(fused)):
        mlp = copied.model.layers[0].mlp
        assert is_fused_swiglu(mlp) and mlp.forward.mlp is mlp
        assert torch.equal(mlp(x), expected)
    assert len(calls) == 2  # both ran the fused kernel


def test_full_backward_hooks_on_down_proj_fire():
    """A full backward hook on down_proj sees its gradients: the call takes the eager path, as with forward hooks."""
    plain, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    seen = {"plain": [], "fused": []}
    for label, model in (("plain", plain), ("fused", fused)):
        down = model.model.layers[0].mlp.down_proj
        down.register_full_backward_hook(lambda m, grad_in, grad_out, _s=seen[label]: _s.append(grad_in[0].clone()))
    logits_p, grads_p = forward_backward(plain, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    assert len(seen["fused"]) == 1 and seen["fused"][0].shape == (2, 24, 512)
    assert torch.equal(seen["fused"][0], seen["plain"][0])
    assert torch.equal(logits_f, logits_p) and all(torch.equal(grads_f[n], g) for n, g in grads_p.items())
