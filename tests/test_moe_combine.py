"""`trl_fp8.kernels.moe_combine`: each token's k expert rows, weighted and summed (in Triton's CPU interpreter here,
compiled on a GPU), against the eager chain `FP8Experts` ran before (scale each row in its dtype, scatter to token
order, sum the slots in fp32, cast) on the same rows.

Bounds: the output and the rows' gradient are the eager chain's values, bit for bit (the same roundings in the same
order). The router weights' gradient is summed in fp32 over the features, where the eager chain rounds each product
to bf16 first: against a float64 sum it is within `H * 2**-24 * sum|dout * y|` plus one rounding to the weights'
dtype, and within the eager one's larger error."""

import pytest
import torch

pytest.importorskip("triton")

from trl_fp8.kernels.moe_combine import combine_rows, combine_rows_backward  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(tokens=37, k=3, h=1280, w_dtype=torch.float32, seed=0):
    """Rows sorted by a random expert assignment: `(y [tokens*k, h], order, pos [tokens, k], weights [tokens, k])`,
    order[s] the (token, slot) pair of sorted row s, pos its inverse."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, 5, (tokens * k,), generator=g)
    order = torch.argsort(experts, stable=True)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
    y = torch.randn(tokens * k, h, generator=g).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1).to(w_dtype)
    return (y.to(DEVICE), order.to(DEVICE), pos.view(tokens, k).to(DEVICE), weights.to(DEVICE))


def eager(y, order, weights, tokens, k):
    """The chain `FP8Experts.forward` runs on the per-expert loop (and ran on the grouped kernels before)."""
    out = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(tokens, k, -1).sum(dim=1, dtype=torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_weighted_sum_and_its_gradients_against_the_eager_chain(w_dtype):
    tokens, k, h = 37, 3, 1280  # h: one full feature block and a partial one
    y, order, pos, weights = routed(tokens, k, h, w_dtype)
    got = combine_rows(y, pos, weights, torch.bfloat16)
    ye, we = y.clone().requires_grad_(), weights.clone().requires_grad_()
    ref = eager(ye, order, we, tokens, k)
    assert torch.equal(got, ref)
    dout = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    ref.backward(dout)
    dy, dw = combine_rows_backward(dout, y, pos, weights, need_dw=True)
    assert torch.equal(dy, ye.grad)
    assert dw.dtype == w_dtype and dw.shape == (tokens, k)
    rows = y.double()[pos]  # [tokens, k, h]
    exact = (dout.double()[:, None, :] * rows).sum(-1)
    bound = h * 2**-24 * (dout.double()[:, None, :] * rows).abs().sum(-1)
    bound = bound + (2**-8 if w_dtype == torch.bfloat16 else 2**-24) * exact.abs()
    assert ((dw.double() - exact).abs() <= bound).all()
    assert (dw.double() - exact).abs().max() <= (we.grad.double() - exact).abs().max()  # no worse than eager


def test_unweighted_sum_is_each_tokens_rows_added_and_its_gradient_a_copy():
    tokens, k, h = 9, 2, 256
    y, order, pos, _ = routed(tokens, k, h)
    got = combine_rows(y, pos, None, torch.float32)
    assert torch.equal(got, y.float()[pos].sum(1))  # two terms: exact in fp32, any order
    dout = torch.randn(tokens, h).to(DEVICE, torch.bfloat16)
    dy, dw = combine_rows_backward(dout, None, pos, None, need_dw=True)
    assert dw is None and torch.equal(dy[pos.reshape(-1)], dout.repeat_interleave(k, 0))


def test_operands_that_do_not_fit_are_refused_and_no_tokens_is_empty():
    y, order, pos, weights = routed(4, 2, 128)
    with pytest.raises(ValueError, match="a row for every"):
        combine_rows(y[:-1], pos, weights, torch.bfloat16)
    with pytest.raises(ValueError, match="weights"):
        combine_rows(y, pos, weights.t(), torch.bfloat16)
    empty = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert combine_rows(y[:0], empty, None, torch.bfloat16).shape == (0, 128)
