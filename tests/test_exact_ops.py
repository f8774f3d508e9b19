"""Exact mode's trainer ops (`trl_fp8.ops.exact`): each forward is the kernel handed in, bit for bit and with the
inputs untouched; each backward is the op's gradient, held to autograd of the same math in float64. The backward
computes in float32, so the bound is float32 rounding over a row's reductions: a relative 1e-5 of the gradient's
scale (float32's unit roundoff is 6e-8; a row of 256 terms grows it to ~1e-6, well inside)."""

import sys

import pytest
import torch

from trl_fp8.ops import exact

torch.manual_seed(0)
EPS = 1e-6


def _close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-5 * scale)


def _shifted(kernel, by=0.5):
    """`kernel`, its output moved by `by`: an op that recomputed instead of passing the kernel's values would not
    show the shift."""

    def shifted(*args, **kwargs):
        out = kernel(*args, **kwargs)
        return tuple(o + by for o in out) if isinstance(out, tuple) else out + by

    return shifted


def test_rms_norm_returns_the_kernels_values_and_the_gradient_of_the_norm():
    x = torch.randn(5, 256, requires_grad=True)
    w = (1 + 0.1 * torch.randn(256)).requires_grad_()
    y = exact.rms_norm(x, w, EPS, kernel=_shifted(exact.reference_rms_norm))
    assert torch.equal(y, exact.reference_rms_norm(x, w, EPS) + 0.5)
    g = torch.randn_like(y)
    y.backward(g)

    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS) * wd).backward(g.double())
    _close(x.grad, xd.grad)
    _close(w.grad, wd.grad)


def test_add_rms_norm_returns_both_kernel_outputs_leaves_its_inputs_and_sends_gradients_through_both():
    x, r = torch.randn(4, 256), torch.randn(4, 256)
    w = 1 + 0.1 * torch.randn(256)
    x0, r0 = x.clone(), r.clone()

    def in_place_kernel(x, weight, eps, *, residual):  # writes its inputs, as vLLM's fused_add_rms_norm does
        normed, total = exact.reference_add_rms_norm(x, weight, eps, residual=residual)
        x.copy_(normed)
        residual.copy_(total)
        return x, residual

    for t in (x, r, w):
        t.requires_grad_()
    normed, total = exact.add_rms_norm(x, r, w, EPS, kernel=in_place_kernel)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    ref_normed, ref_total = exact.reference_add_rms_norm(x0, w.detach(), EPS, residual=r0)
    assert torch.equal(normed, ref_normed) and torch.equal(total, ref_total)

    g_normed, g_total = torch.randn_like(normed), torch.randn_like(total)
    (normed * g_normed).sum().add((total * g_total).sum()).backward()
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
    s = xd + rd
    ((s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS) * wd * g_normed.double()).sum()
     + (s * g_total.double()).sum()).backward()  # fmt: skip
    _close(x.grad, xd.grad)
    _close(r.grad, rd.grad)
    _close(w.grad, wd.grad)


def test_token_logprobs_returns_the_kernels_values_and_the_log_softmax_gradient():
    logits = torch.randn(3, 7, 300, requires_grad=True)
    ids = torch.randint(0, 300, (3, 7))
    seen = []

    def kernel(rows, token_ids):
        seen.append((rows.shape, token_ids.shape, token_ids.dtype))
        return exact.reference_token_logprobs(rows, token_ids) - 0.25

    out = exact.token_logprobs(logits, ids, kernel=kernel)
    assert seen == [((21, 300), (21, 1), torch.int64)]
    ref = logits.detach().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert out.shape == ids.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref - 0.25, rtol=0, atol=0)  # the kernel's very values
    g = torch.randn_like(out)
    out.backward(g)
    ld = logits.detach().double().requires_grad_()
    ld.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).backward(g.double())
    _close(logits.grad, ld.grad)


def test_token_logprobs_backward_in_row_chunks_matches_one_pass(monkeypatch):
    module = sys.modules["trl_fp8.ops.exact.token_logprobs"]  # the file (the package's name is the function)

    logits = torch.randn(10, 50, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 50, (10,))
    exact.token_logprobs(logits, ids).sum().backward()
    whole = logits.grad.clone()
    logits.grad = None
    monkeypatch.setattr(module, "BACKWARD_ROWS", 3)
    exact.token_logprobs(logits, ids).sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.equal(logits.grad, whole)


def test_silu_and_mul_returns_the_kernels_values_and_the_gated_gradient():
    gate_up = torch.randn(6, 2 * 128, requires_grad=True)
    out = exact.silu_and_mul(gate_up, kernel=_shifted(exact.reference_silu_and_mul))
    assert torch.equal(out, exact.reference_silu_and_mul(gate_up.detach()) + 0.5)
    g = torch.randn_like(out)
    out.backward(g)
    gd = gate_up.detach().double().requires_grad_()
    gate, up = gd.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(g.double())
    _close(gate_up.grad, gd.grad)


@pytest.mark.parametrize("rotary_dim", [128, 64])  # the whole head, and a partial rotary (the rest passes through)
def test_rotary_rotates_with_the_kernel_and_the_engines_table_and_back_in_the_backward(rotary_dim):
    head, positions = 128, torch.tensor([0, 1, 5, 2, 300])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.outer(torch.arange(512).float(), inv_freq)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # vLLM's layout: cosines, then sines
    q = torch.randn(5, 4 * head, requires_grad=True)
    k = torch.randn(5, 2 * head, requires_grad=True)
    q0, k0 = q.detach().clone(), k.detach().clone()
    rq, rk = exact.rotary(positions, q, k, head, cache)
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0)

    def hf_rotate(x):  # transformers' rotate_half form, in float64
        cos = torch.cat([angles.cos(), angles.cos()], -1)[positions].double().unsqueeze(1)
        sin = torch.cat([angles.sin(), angles.sin()], -1)[positions].double().unsqueeze(1)
        h = x.reshape(5, -1, head)
        rot, rest = h[..., :rotary_dim], h[..., rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat([rot * cos + torch.cat([-x2, x1], -1) * sin, rest], -1).reshape(x.shape)

    qd, kd = q0.double().requires_grad_(), k0.double().requires_grad_()
    _close(rq.detach(), hf_rotate(qd).detach())
    _close(rk.detach(), hf_rotate(kd).detach())
    gq, gk = torch.randn_like(rq), torch.randn_like(rk)
    ((rq * gq).sum() + (rk * gk).sum()).backward()
    ((hf_rotate(qd) * gq.double()).sum() + (hf_rotate(kd) * gk.double()).sum()).backward()
    _close(q.grad, qd.grad)
    _close(k.grad, kd.grad)


def test_attention_returns_the_kernels_values_and_each_sequences_causal_gradient():
    lengths, heads_q, heads_kv, dim = [5, 1, 9], 4, 2, 16
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q = torch.randn(15, heads_q, dim, requires_grad=True)
    k = torch.randn(15, heads_kv, dim, requires_grad=True)
    v = torch.randn(15, heads_kv, dim, requires_grad=True)
    scale = dim**-0.5
    out = exact.attention(q, k, v, cu, max(lengths), scale, kernel=_shifted(exact.reference_attention))
    assert torch.equal(out, exact.reference_attention(q.detach(), k.detach(), v.detach(), cu, 9, scale) + 0.5)
    g = torch.randn_like(out)
    out.backward(g)

    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    pieces = []
    for a, b in ((0, 5), (5, 6), (6, 15)):  # each sequence alone, every query head reading its group's key head
        s = torch.einsum("qhd,khd->hqk", qd[a:b], kd[a:b].repeat_interleave(2, dim=1)) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        pieces.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vd[a:b].repeat_interleave(2, dim=1)))
    torch.cat(pieces).backward(g.double())
    for ours, reference in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        _close(ours, reference)


def test_attention_over_an_fp8_cache_hands_the_kernel_the_scales_and_passes_the_gradient_straight_through():
    """With the layer's (q, k, v) scales the kernel gets them; the reference attends over what an FP8 cache and an
    FP8 query hold (`x / scale` rounded to e4m3, times `scale`), which moves its output by FP8's rounding and no
    more; the gradient is the BF16 attention's, the rounding passed straight through."""
    from trl_fp8.ops.exact.attention import fp8_round_trip

    lengths, heads_q, heads_kv, dim = [5, 1, 9], 4, 2, 16
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q, k, v = (torch.randn(15, h, dim, requires_grad=True) for h in (heads_q, heads_kv, heads_kv))
    scale = dim**-0.5
    scales = tuple(x.detach().abs().amax() / 448 for x in (q, k, v))  # as the observer measures them
    given = []

    def kernel(*args, scales=None):
        given.append(scales)
        return exact.reference_attention(*args, scales=scales)

    out = exact.attention(q, k, v, cu, max(lengths), scale, kernel=kernel, scales=scales)
    assert given == [scales]
    rounded = [fp8_round_trip(x.detach(), s) for x, s in zip((q, k, v), scales, strict=True)]
    assert torch.equal(out, exact.reference_attention(*rounded, cu, 9, scale))
    exact_out = exact.reference_attention(q.detach(), k.detach(), v.detach(), cu, 9, scale)
    # e4m3 keeps 3 mantissa bits: each operand within 2^-4 of itself, so the output within a few times that (the
    # scores' error is that of a dot product of two such operands, the output's that of a convex mix of V's rows)
    assert 0 < (out - exact_out).abs().max() < 4 * 2**-4 * exact_out.abs().max()
    g = torch.randn_like(out)
    out.backward(g)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    exact.attention(q, k, v, cu, max(lengths), scale).backward(g)  # the BF16 cache's gradient
    for ours, bf16 in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert torch.equal(ours, bf16)


def test_fp8_linear_forward_and_gradients_are_fp8_linears_own():
    from torch import nn

    from trl_fp8 import FP8LinearConfig
    from trl_fp8.nn.linear import FP8Linear

    layer = FP8Linear.convert_(nn.Linear(256, 384, bias=False), FP8LinearConfig(backend="emulated"))
    x = torch.randn(2, 7, 256, requires_grad=True)
    ours = exact.fp8_linear(x, layer)
    g = torch.randn_like(ours)
    ours.backward(g)
    grads = x.grad.clone(), layer.weight.grad.clone()
    x.grad, layer.weight.grad = None, None
    theirs = layer(x)
    theirs.backward(g)
    assert torch.equal(ours, theirs)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], layer.weight.grad)

    seen = []

    def kernel(x2d, q, s, dtype):
        seen.append((tuple(x2d.shape), q.dtype, tuple(s.shape), dtype))
        return exact.reference_fp8_linear(x2d, q, s, dtype) + 1

    shifted = exact.fp8_linear(x.detach(), layer, kernel=kernel)
    assert seen == [((14, 256), torch.float8_e4m3fn, (3, 2), torch.float32)]
    assert torch.equal(shifted, theirs.detach() + 1)
