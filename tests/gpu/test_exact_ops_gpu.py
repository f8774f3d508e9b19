"""Exact mode's trainer ops on vLLM's own kernels (`rollout.vllm.exact.exact_kernels`): each forward gives the bits
the kernel gives when vLLM calls it, the same bits for a row whatever else is in the launch (8 rows or 300), and
values within bfloat16 rounding of the op's math; each backward matches the one computed from the reference kernel.
And exact mode's whole forward of a small FP8 Qwen3 on those kernels: a sequence's log-probabilities the same bits
alone and packed with others, and within rounding of the reference kernels'.
"""

import pytest
import torch

from trl_fp8.ops import exact

pytestmark = pytest.mark.gpu
HIDDEN, HEAD = 4096, 128
BF16_ULP = 2.0**-7  # bfloat16's relative spacing: the bound on one rounding of the output


@pytest.fixture(scope="module")
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from trl_fp8.rollout.vllm.exact import exact_kernels

    return exact_kernels()


def _rows(n, width=HIDDEN, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, width, device="cuda", generator=g).to(torch.bfloat16)


def _within_rounding(ours, reference):
    scale = reference.float().abs().max().item()
    torch.testing.assert_close(ours.float(), reference.float(), rtol=2 * BF16_ULP, atol=2 * BF16_ULP * scale)


def test_rms_norm_on_vllms_kernel_is_row_invariant_and_its_gradient_is_the_references(kernels):
    w = (1 + 0.1 * _rows(1, seed=1)[0]).requires_grad_()
    x = _rows(300).requires_grad_()
    y = exact.rms_norm(x, w, 1e-6, kernel=kernels.rms_norm)
    assert torch.equal(y, kernels.rms_norm(x.detach(), w.detach(), 1e-6))
    assert torch.equal(exact.rms_norm(x[:8], w, 1e-6, kernel=kernels.rms_norm), y[:8])
    _within_rounding(y, exact.reference_rms_norm(x.detach(), w.detach(), 1e-6))
    y.float().sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    exact.rms_norm(xr, wr, 1e-6).float().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_add_rms_norm_on_vllms_kernel_is_row_invariant_and_leaves_its_inputs(kernels):
    w = 1 + 0.1 * _rows(1, seed=1)[0]
    x, r = _rows(300, seed=2), _rows(300, seed=3)
    x0, r0 = x.clone(), r.clone()
    normed, total = exact.add_rms_norm(x, r, w, 1e-6, kernel=kernels.add_rms_norm)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    assert torch.equal(total, x0 + r0)
    few_normed, few_total = exact.add_rms_norm(x[:8], r[:8], w, 1e-6, kernel=kernels.add_rms_norm)
    assert torch.equal(few_normed, normed[:8]) and torch.equal(few_total, total[:8])
    _within_rounding(normed, exact.reference_add_rms_norm(x0, w, 1e-6, residual=r0)[0])


def test_token_logprobs_on_vllms_kernel_is_row_invariant_and_exact_to_float32(kernels):
    logits = _rows(300, width=151_936, seed=4).requires_grad_()
    ids = torch.randint(0, 151_936, (300,), device="cuda")
    out = exact.token_logprobs(logits, ids, kernel=kernels.token_logprobs)
    assert torch.equal(exact.token_logprobs(logits[:8], ids[:8], kernel=kernels.token_logprobs), out[:8])
    reference = logits.detach().float().log_softmax(-1).gather(-1, ids[:, None])[:, 0]
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4)  # float32 sums over 151,936 terms
    out.sum().backward()
    lr = logits.detach().clone().requires_grad_()
    exact.token_logprobs(lr, ids).sum().backward()
    torch.testing.assert_close(logits.grad, lr.grad)


def test_silu_and_mul_on_vllms_kernel_is_row_invariant(kernels):
    gate_up = _rows(300, width=2 * 12288, seed=5)
    out = exact.silu_and_mul(gate_up, kernel=kernels.silu_and_mul)
    assert torch.equal(exact.silu_and_mul(gate_up[:8], kernel=kernels.silu_and_mul), out[:8])
    _within_rounding(out, exact.reference_silu_and_mul(gate_up))


def test_rotary_on_vllms_kernel_matches_the_reference_and_leaves_its_inputs(kernels):
    positions = torch.arange(300, device="cuda")
    inv_freq = 1.0 / (1_000_000 ** (torch.arange(0, HEAD, 2, device="cuda").float() / HEAD))
    angles = torch.outer(torch.arange(4096, device="cuda").float(), inv_freq)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.bfloat16)  # as vLLM holds it
    q, k = _rows(300, width=32 * HEAD, seed=6), _rows(300, width=8 * HEAD, seed=7)
    q0, k0 = q.clone(), k.clone()
    rq, rk = exact.rotary(positions, q, k, HEAD, cache, kernel=kernels.rotary)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    few_q, few_k = exact.rotary(positions[:8], q[:8], k[:8], HEAD, cache, kernel=kernels.rotary)
    assert torch.equal(few_q, rq[:8]) and torch.equal(few_k, rk[:8])
    ref_q, ref_k = exact.rotary(positions, q, k, HEAD, cache)
    _within_rounding(rq, ref_q)
    _within_rounding(rk, ref_k)


def test_attention_on_vllms_kernel_gives_a_sequence_the_same_bits_alone_and_packed(kernels):
    lengths = [300, 17, 129]
    cu = torch.tensor([0, 300, 317, 446], dtype=torch.int32, device="cuda")
    q, k, v = (_rows(446, width=h * HEAD, seed=8 + i).view(446, h, HEAD) for i, h in enumerate((32, 8, 8)))
    packed = exact.attention(q, k, v, cu, max(lengths), HEAD**-0.5, kernel=kernels.attention)
    one = torch.tensor([0, 17], dtype=torch.int32, device="cuda")
    alone = exact.attention(q[300:317], k[300:317], v[300:317], one, 17, HEAD**-0.5, kernel=kernels.attention)
    assert torch.equal(alone, packed[300:317])
    _within_rounding(packed, exact.reference_attention(q, k, v, cu, 300, HEAD**-0.5))


def test_attention_gradient_over_the_pack_is_the_float64_gradient_within_bfloat16_rounding():
    """The backward's recomputation: PyTorch's variable-length FlashAttention over the whole pack, query heads
    sharing their group's key head, against each sequence's gradient in float64 (SDPA, the path other devices take).
    A wrong causal mask, head grouping or sequence boundary moves a gradient by its own size, not by rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trl_fp8.ops.exact.attention import _varlen_flash, attention_gradients

    if _varlen_flash() is None:
        pytest.skip("this torch's varlen_attn takes no grouped-query heads (torch 2.13's does)")
    lengths = [300, 17, 1, 190]
    total = sum(lengths)
    cu = torch.tensor([0, 300, 317, 318, 508], dtype=torch.int32, device="cuda")
    q, k, v = (_rows(total, width=h * HEAD, seed=20 + i).view(total, h, HEAD) for i, h in enumerate((32, 8, 8)))
    grad = _rows(total, width=32 * HEAD, seed=23).view(total, 32, HEAD)
    flash = attention_gradients(q, k, v, grad, cu, max(lengths), HEAD**-0.5)
    # on the CPU: a process that started an engine in exact mode has vLLM's Triton bmm in place of CUDA's
    on_cpu = (t.double().cpu() for t in (q, k, v, grad))
    reference = attention_gradients(*on_cpu, cu.cpu(), max(lengths), HEAD**-0.5)
    for ours, exact_grad in zip(flash, reference, strict=True):
        assert ours.dtype == torch.bfloat16 and ours.shape == exact_grad.shape
        # FlashAttention's backward rounds the probabilities and their gradient to bfloat16 before its matmuls (fp32
        # accumulation): a few roundings of the output's scale
        scale = exact_grad.abs().max().item()
        torch.testing.assert_close(ours.double().cpu(), exact_grad, rtol=4 * BF16_ULP, atol=4 * BF16_ULP * scale)


def test_attention_over_an_fp8_cache_on_vllms_kernels_gives_a_sequence_the_same_bits_alone_and_packed(kernels):
    """The FP8 KV cache's path: keys and values written by vLLM's cache kernel, the query quantized by a static
    per-tensor `QuantFP8` (the engine's `Attention.query_quant`), FA3 descaling all three. Within FP8's rounding of
    the reference over the same quantized values (FA3 also rounds the probabilities to FP8 for P @ V: a few e4m3
    steps, 2^-4 relative each, of the output's scale)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from trl_fp8.rollout.vllm.exact import exact_kernels

    with set_current_vllm_config(VllmConfig()):  # a CustomOp reads the engine's config when it is built
        query_quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    attention = exact_kernels(query_quant).attention
    lengths = [300, 17, 129]
    cu = torch.tensor([0, 300, 317, 446], dtype=torch.int32, device="cuda")
    q, k, v = (_rows(446, width=h * HEAD, seed=8 + i).view(446, h, HEAD) for i, h in enumerate((32, 8, 8)))
    scales = tuple(x.float().abs().amax() / 448 for x in (q, k, v))
    packed = exact.attention(q, k, v, cu, max(lengths), HEAD**-0.5, kernel=attention, scales=scales)
    one = torch.tensor([0, 17], dtype=torch.int32, device="cuda")
    alone = exact.attention(q[300:317], k[300:317], v[300:317], one, 17, HEAD**-0.5, kernel=attention, scales=scales)
    assert torch.equal(alone, packed[300:317])
    reference = exact.reference_attention(q, k, v, cu, 300, HEAD**-0.5, scales=scales)
    bf16 = exact.reference_attention(q, k, v, cu, 300, HEAD**-0.5)
    scale = reference.float().abs().max().item()
    torch.testing.assert_close(packed.float(), reference.float(), rtol=2**-3, atol=2**-3 * scale)
    assert not torch.equal(packed, bf16)  # the FP8 path ran, not the BF16 one


def test_fp8_linear_on_vllms_kernels_is_row_invariant_and_close_to_fp8_linears_own(kernels):
    from torch import nn

    from trl_fp8 import FP8LinearConfig
    from trl_fp8.nn.linear import FP8Linear

    layer = FP8Linear.convert_(nn.Linear(HIDDEN, 6144, bias=False, device="cuda", dtype=torch.bfloat16),
                               FP8LinearConfig())  # fmt: skip
    x = _rows(300, seed=11)
    out = exact.fp8_linear(x, layer, kernel=kernels.fp8_linear)
    assert torch.equal(exact.fp8_linear(x[:7], layer, kernel=kernels.fp8_linear), out[:7])
    _within_rounding(out, layer(x).detach())


def test_the_lm_head_on_vllms_kernel_is_row_invariant(kernels):
    weight = _rows(151_936 // 8, seed=12)
    x = _rows(300, seed=13)
    out = exact.linear(x, weight, kernel=kernels.linear)
    assert torch.equal(exact.linear(x[:8], weight, kernel=kernels.linear), out[:8])
    _within_rounding(out, exact.reference_linear(x, weight))


def test_the_exact_forward_on_vllms_kernels_gives_a_sequence_the_same_log_probabilities_alone_and_packed(kernels):
    from trl_fp8 import convert_to_fp8
    from trl_fp8.demo.tiny_model import tiny_qwen3
    from trl_fp8.nn.exact_forward import exact_token_logprobs

    model = tiny_qwen3(num_hidden_layers=2, dtype=torch.bfloat16).cuda()
    convert_to_fp8(model)
    g = torch.Generator(device="cuda").manual_seed(14)
    ids = torch.randint(4, 256, (4, 96), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0  # a shorter prompt, left-padded
    mask[2, 90:] = 0  # a completion that ended early
    with torch.no_grad():
        packed, _ = exact_token_logprobs(model, ids, mask, 32, kernels=kernels)
        alone, _ = exact_token_logprobs(model, ids[1:2], mask[1:2], 32, kernels=kernels)
        reference, _ = exact_token_logprobs(model, ids, mask, 32)
    assert torch.equal(alone[0], packed[1])
    torch.testing.assert_close(packed, reference, rtol=0, atol=0.05)  # bfloat16 and FP8 roundings over 2 layers
