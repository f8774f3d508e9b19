"""FP8Linear (emulated backend) against float64 references.

Two references, two kinds of bound:
- the *quantized* float64 reference (operands quantized by an independent per-group loop, then multiplied in
  float64) checks which axis each GEMM operand is grouped along and every scale: the emulation may differ from it
  only by fp32 summation order (measured 3e-7 relative; bound 1e-5). A wrong scale, grouping axis or padding gives
  errors of order 1e-2 or more.
- the *unquantized* float64 matmul bounds the total FP8 error: measured 0.034-0.038 relative (also with power-of-two scales) for Gaussian data
  (e4m3 keeps 3 mantissa bits), asserted to lie in [0.02, 0.06], which also proves FP8 rounding really happens.
"""

import pytest
import torch
from torch import nn

from trl_fp8 import FP8Linear, FP8LinearConfig, quantize_blocks
from trl_fp8.nn.linear import FP8Weight, _BlockwiseFP8Matmul, invalidate_fp8_weights

from conftest import assert_fp8_equal, rel_err

FP8_MAX = 448.0


def _qdq_rows(a: torch.Tensor, size: int = 128) -> torch.Tensor:
    """Quantize-dequantize each row of `a` in chunks of `size` along dim 1 (a partial last chunk is its own group)."""
    out = torch.empty_like(a, dtype=torch.float64)
    for j in range(0, a.shape[1], size):
        chunk = a[:, j : j + size].double()
        scale = (FP8_MAX / chunk.abs().amax(1, keepdim=True).clamp(min=1e-12)).float().double()
        q = (chunk * scale).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn)
        out[:, j : j + size] = q.double() * (1 / scale.float()).double()
    return out


def _qdq_blocks(w: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(w, dtype=torch.float64)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            blk = w[i : i + 128, j : j + 128].double()
            scale = (FP8_MAX / blk.abs().max().clamp(min=1e-12)).float().double()
            q = (blk * scale).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn)
            out[i : i + 128, j : j + 128] = q.double() * (1 / scale.float()).double()
    return out


def quantized_reference(x2d, w, dy2d):
    """out, dx, dW of y = x @ W.T with each GEMM's operands quantized as the blockwise recipe says."""
    wq = _qdq_blocks(w)
    out = _qdq_rows(x2d) @ wq.t()  # FProp: x grouped along K
    dx = _qdq_rows(dy2d) @ wq  # DGrad: dy grouped along N
    dw = _qdq_rows(dy2d.t()) @ _qdq_rows(x2d.t()).t()  # WGrad: dy.T and x.T grouped along tokens
    return out, dx, dw


def make_layer(n=384, k=256, bias=False, dtype=torch.float32, **cfg):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias).to(dtype)
    ref_w = lin.weight.detach().clone()
    FP8Linear.convert_(lin, FP8LinearConfig(backend="emulated", **cfg))
    return lin, ref_w


def run(lin, x, dy):
    x = x.clone().requires_grad_()
    out = lin(x)
    out.backward(dy)
    return out, x.grad, lin.weight.grad


@pytest.mark.parametrize("lead", [(256,), (100,), (3, 37), (2, 128)])
def test_matches_quantized_float64_reference(lead):
    lin, w = make_layer()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*lead, 256, generator=g)
    dy = torch.randn(*lead, 384, generator=g)
    out, dx, dw = run(lin, x, dy)
    r_out, r_dx, r_dw = quantized_reference(x.reshape(-1, 256), w, dy.reshape(-1, 384))
    assert out.shape == (*lead, 384) and dx.shape == x.shape and dw.shape == w.shape
    assert rel_err(out.reshape(-1, 384), r_out) < 1e-5
    assert rel_err(dx.reshape(-1, 256), r_dx) < 1e-5
    assert rel_err(dw, r_dw) < 1e-5


def test_a_wrong_grouping_axis_would_be_caught():
    """The quantized reference distinguishes grouping axes: WGrad grouped along K instead of tokens is far off."""
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(256, 256, generator=g), torch.randn(256, 384, generator=g)
    x[:, :3] *= 100  # outlier channels make the grouping axis matter, as in real activations
    right = _qdq_rows(dy.t()) @ _qdq_rows(x.t()).t()
    wrong = _qdq_rows(dy).t() @ _qdq_rows(x)
    assert rel_err(wrong, right) > 1e-3


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_error_against_unquantized_float64(pow2):
    lin, w = make_layer(power_of_two_scales=pow2)
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(512, 256, generator=g), torch.randn(512, 384, generator=g)
    out, dx, dw = run(lin, x, dy)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    errs = [rel_err(out, xd @ wd.t()), rel_err(dx, dyd @ wd), rel_err(dw, dyd.t() @ xd)]
    for e in errs:
        assert 0.02 < e < 0.06, errs


def test_bf16_master_weights_and_bf16_gradients():
    lin, w = make_layer(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(200, 256, generator=g).bfloat16()
    dy = torch.randn(200, 384, generator=g).bfloat16()
    out, dx, dw = run(lin, x, dy)
    assert out.dtype == dx.dtype == dw.dtype == torch.bfloat16
    r_out, r_dx, r_dw = quantized_reference(x.float(), w.float(), dy.float())
    # only the final rounding to bf16 differs (2**-9 relative per element)
    assert rel_err(out, r_out) < 4e-3 and rel_err(dx, r_dx) < 4e-3 and rel_err(dw, r_dw) < 4e-3


def test_bias_frozen_weight_and_input_without_grad():
    lin, w = make_layer(bias=True)
    x = torch.randn(130, 256)
    lin.weight.requires_grad_(False)  # e.g. a frozen LoRA base layer: only dx is computed
    xr = x.clone().requires_grad_()
    out = lin(xr)
    out.sum().backward()
    assert lin.weight.grad is None and xr.grad is not None and lin.bias.grad is not None
    torch.testing.assert_close(lin.bias.grad, torch.full((384,), 130.0))
    lin.weight.requires_grad_(True)
    lin(x).sum().backward()  # input without grad: only dW
    assert lin.weight.grad is not None


def test_weight_cache_quantizes_once_per_weight_version(monkeypatch):
    lin, _ = make_layer()
    from trl_fp8.ops import emulated

    calls = []
    orig = emulated.quantize_weight
    # row-major calls only: DGrad re-quantizes into its own layout on every backward, by design
    monkeypatch.setattr(
        emulated, "quantize_weight", lambda w, **kw: kw.get("col_major") or calls.append(1) or orig(w, **kw)
    )
    x = torch.randn(64, 256)
    for _ in range(3):  # micro-batches and log-prob passes with unchanged weights
        lin(x).sum().backward()
    assert len(calls) == 1
    q, s = lin.quantized_weight()
    q_ref, s_ref = quantize_blocks(lin.weight.detach())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    torch.optim.SGD(lin.parameters(), lr=0.1).step()  # in-place update bumps the weight's version
    lin(x)
    assert len(calls) == 2
    q2, _ = lin.quantized_weight()
    assert not torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("opt_kwargs", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_any_optimizer_step_invalidates_the_cache(opt_kwargs):
    """Fused AdamW (the transformers default) does not bump the weight's version counter: the cache must still see
    the update, or the forward would keep multiplying the old FP8 weight."""
    lin, _ = make_layer()
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, **opt_kwargs)
    x = torch.randn(16, 256)
    lin(x).sum().backward()
    old_q, _ = lin.quantized_weight()
    opt.step()
    q, s = lin.quantized_weight()
    q_ref, s_ref = quantize_blocks(lin.weight.detach())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert not torch.equal(q.view(torch.uint8), old_q.view(torch.uint8))


def test_cache_can_be_disabled(monkeypatch):
    lin, _ = make_layer(cache_quantized_weight=False)
    lin(torch.randn(8, 256))
    assert lin._fp8_weight_cache is None


def test_forward_uses_exactly_the_exported_weight():
    """`quantized_weight()` (what vLLM sync and export send) is bit for bit the FP8 weight the forward multiplies."""
    lin, w = make_layer()
    from trl_fp8.ops import emulated

    x = torch.randn(4, 256)
    w_q, w_s = lin.quantized_weight()
    q_ref, s_ref = quantize_blocks(w)
    assert torch.equal(w_q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(w_s, s_ref)
    fp8_weight = FP8Weight(lin.weight, emulated, False)
    expected = _BlockwiseFP8Matmul.apply(x, lin.weight, fp8_weight)
    assert torch.equal(lin(x), expected)
    fp8_weight.q.view(torch.uint8)[0, 0] ^= 0x80  # flipping one weight's sign bit changes the output
    assert not torch.equal(_BlockwiseFP8Matmul.apply(x, lin.weight, fp8_weight), expected)


def _assert_serves(lin: FP8Linear, weight: torch.Tensor) -> None:
    """The layer's FP8 weight (what its forward multiplies, what export and vLLM get) is the quantization of `weight`."""
    assert_fp8_equal(*lin.quantized_weight(), weight)


def test_data_writes_are_picked_up_after_invalidate():
    lin, w = make_layer()
    lin(torch.randn(4, 256))
    with torch.no_grad():
        lin.weight.data.mul_(-2.0)  # behind autograd's back: no version bump, same storage
    assert invalidate_fp8_weights(lin) == 1
    _assert_serves(lin, -2.0 * w)
    lin.weight.data = w.clone()  # a new tensor behind the parameter needs nothing
    _assert_serves(lin, w)


def test_load_state_dict_refreshes_the_fp8_weight():
    lin, w = make_layer()
    lin(torch.randn(4, 256))
    lin.load_state_dict({"weight": w * 3.0})
    _assert_serves(lin, w * 3.0)
    lin.load_state_dict({"weight": w * 0.5}, assign=True)
    _assert_serves(lin, w * 0.5)


@pytest.mark.parametrize("safe_merge", [False, True])
def test_peft_merge_unmerge_and_merge_and_unload_refresh_the_fp8_weight(safe_merge):
    from peft import LoraConfig, get_peft_model

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(256, 384, bias=False)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    block = Block()
    base = block.proj.weight.detach().clone()
    FP8Linear.convert_(block.proj, FP8LinearConfig(backend="emulated"))
    model = get_peft_model(block, LoraConfig(r=4, target_modules=["proj"], init_lora_weights=False))
    lora = model.base_model.model.proj
    merged = base + lora.get_delta_weight("default")
    x = torch.randn(8, 256)
    model(x)  # caches the FP8 base weight
    _assert_serves(lora.base_layer, base)

    lora.merge(safe_merge=safe_merge)  # PEFT writes `weight.data += delta` (or swaps .data when safe)
    _assert_serves(lora.base_layer, lora.base_layer.weight.detach())
    torch.testing.assert_close(lora.base_layer.weight.detach(), merged)
    lora.unmerge()
    _assert_serves(lora.base_layer, lora.base_layer.weight.detach())
    torch.testing.assert_close(lora.base_layer.weight.detach(), base, rtol=0, atol=1e-6)

    unloaded = model.merge_and_unload(safe_merge=safe_merge)
    assert isinstance(unloaded.proj, FP8Linear)
    _assert_serves(unloaded.proj, unloaded.proj.weight.detach())
    torch.testing.assert_close(unloaded.proj.weight.detach(), merged)


def test_frozen_weights_quantize_once_trainable_ones_once_per_step(monkeypatch):
    from trl_fp8.ops import emulated

    frozen, _ = make_layer()
    frozen.weight.requires_grad_(False)  # a LoRA base layer or the reference model
    trainable, _ = make_layer(n=256, k=384)
    calls = []
    orig = emulated.quantize_weight
    monkeypatch.setattr(
        emulated,
        "quantize_weight",
        lambda w, **kw: kw.get("col_major") or calls.append(w.data_ptr()) or orig(w, **kw),
    )
    opt = torch.optim.AdamW(trainable.parameters(), lr=0.1, fused=True)
    x = torch.randn(16, 256)
    for _ in range(3):
        trainable(frozen(x)).sum().backward()
        opt.step()
    assert calls.count(frozen.weight.data_ptr()) == 1
    assert calls.count(trainable.weight.data_ptr()) == 3


def test_layers_reading_one_input_quantize_it_once(monkeypatch):
    """q/k/v (or gate/up) read the same tensor: its FP8 operands are made once and give the very same results as
    three separate quantizations; an in-place change of the input or a new tensor quantizes again."""
    from trl_fp8.ops import emulated

    layers = [make_layer(n=n)[0] for n in (384, 128, 128)]
    calls = []
    orig = emulated.quantize_act
    monkeypatch.setattr(emulated, "quantize_act", lambda x, **kw: calls.append(kw.get("cols")) or orig(x, **kw))
    base = torch.randn(2, 40, 256, requires_grad=True)
    x = base * 1.0  # a non-leaf activation, as a norm's output is
    shared = [layer(x) for layer in layers]
    assert calls == [True]  # one forward quantization, both layouts (WGrad's comes from it too)
    sum(o.square().sum() for o in shared).backward()
    shared_grads = [base.grad.clone()] + [layer.weight.grad.clone() for layer in layers]
    for layer in layers:
        layer.weight.grad = None
    base.grad = None
    calls.clear()
    separate = [layer(base * 1.0) for layer in layers]  # a new tensor per layer
    assert calls == [True, True, True]
    sum(o.square().sum() for o in separate).backward()
    for a, b in zip(shared, separate, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(shared_grads, [base.grad] + [layer.weight.grad for layer in layers], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    calls.clear()
    with torch.no_grad():
        y = base * 1.0
        first = layers[0](y)
        y.add_(1.0)  # in place: the version counter moves, the cached operands are stale
        assert not torch.equal(layers[0](y), first)
    assert calls == [False, False]  # no-grad forwards skip WGrad's layout


def test_backward_keeps_the_input_in_fp8_not_bf16():
    """WGrad's operand is saved as the forward made it, FP8 x.T in token groups: half the bytes of the BF16 input
    that nn.Linear keeps, and no second quantization of x in backward."""
    lin, _ = make_layer(dtype=torch.bfloat16)
    x = torch.randn(3, 100, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = lin(x)
    assert (torch.float8_e4m3fn, (256, 384)) in saved  # x.T, 300 tokens padded to 384
    assert not any(dtype == torch.bfloat16 and shape[-1] == 256 and shape != (384, 256) for dtype, shape in saved)
    out.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_torch_compile_traces_the_layer_in_one_graph():
    """`torch.compile(fullgraph=True)` traces forward and backward with no graph break (the weight cache and the
    shared-input reuse step aside there) and computes the same bits as eager."""
    import torch._dynamo

    torch._dynamo.reset()
    lin, _ = make_layer()
    x = torch.randn(3, 40, 256, requires_grad=True)
    out = lin(x)
    out.square().sum().backward()
    eager = (out.detach(), x.grad.clone(), lin.weight.grad.clone())
    x.grad = lin.weight.grad = None
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    for a, b in zip(eager, (out.detach(), x.grad, lin.weight.grad), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_recomputes_the_same_gradients(use_reentrant):
    """Under torch.utils.checkpoint (what `gradient_checkpointing=True` runs) the recomputed forward saves the same
    FP8 operands, shared-input reuse included, and the gradients equal those of a plain backward."""
    from torch.utils.checkpoint import checkpoint

    layers = nn.ModuleList(make_layer(n=n)[0] for n in (256, 128))

    def block(x):
        h = x * 1.0  # one tensor read by two layers, as q/k/v read the norm's output
        return layers[0](h).sum(-1) + layers[1](h).sum(-1)

    x = torch.randn(2, 70, 256, requires_grad=True)
    grads = []
    for ckpt in (False, True):
        x.grad = None
        for layer in layers:
            layer.weight.grad = None
        out = checkpoint(block, x, use_reentrant=use_reentrant) if ckpt else block(x)
        out.square().sum().backward()
        grads.append([x.grad.clone()] + [layer.weight.grad.clone() for layer in layers])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["scaled_mm", "deepgemm"])
def test_real_kernel_backends_refuse_a_cpu_weight_naming_the_fix(backend):
    lin = FP8Linear.convert_(nn.Linear(128, 128, bias=False), FP8LinearConfig(backend=backend))
    with pytest.raises(RuntimeError, match=f"backend='{backend}' needs a CUDA SM90 GPU.*backend='auto'"):
        lin(torch.randn(4, 128))


def test_deepgemm_backend_without_vllm_names_the_extra(monkeypatch):
    import builtins

    from trl_fp8.ops import deep_gemm

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name.startswith("vllm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    assert "pip install 'trl-fp8[vllm]'" in deep_gemm.available()
