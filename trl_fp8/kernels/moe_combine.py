"""The end of a mixture-of-experts layer: each token's k expert outputs, weighted by the router and summed, in one
pass forward and one backward.

The routed rows come sorted by expert (`y [num_rows, H]`, row `pos[t * k + j]` holding token t's j-th expert). Forward,
one program per token and feature block: `out[t] = sum_j bf16(y[pos[t, j]] * bf16(w[t, j]))`, summed in fp32 in slot
order j = 0..k-1 and rounded once to the output's dtype: the values of the eager chain it replaces (scale each row by
its weight in y's dtype, scatter back to token order, sum the k slots in fp32, cast; `nn.experts.FP8Experts.forward`),
whose five passes over the routed rows become one read. Backward, one program per token: `dy[pos[t, j]] =
bf16(dout[t] * bf16(w[t, j]))` (the eager chain's values) and `dw[t, j] = sum_h dout[t, h] * y[pos[t, j], h]`, summed in
fp32 and rounded once to w's dtype (the eager chain rounds each product to bf16 first: this is closer to the exact
sum). Unweighted (`w` None), it sums a token's k rows: the gradient of the rows gathered per token at the layer's start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["combine_rows", "combine_rows_backward"]

BLOCK_H = 1024  # features per program: a token's k rows of one block are read once, with no reduction across programs


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, pos_ptr, out_ptr, H, stride_y, stride_out,
    K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pos_ptr + t * K + j).to(tl.int64)
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
        if WEIGHTED:  # as the eager `y * w.to(y.dtype)`: the weight, then the product, in y's dtype
            w = tl.load(w_ptr + t * K + j).to(y_ptr.dtype.element_ty).to(tl.float32)
            acc += (y.to(tl.float32) * w).to(y_ptr.dtype.element_ty).to(tl.float32)
        else:
            acc += y.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_backward_kernel(
    dout_ptr, y_ptr, w_ptr, pos_ptr, dy_ptr, dw_ptr, H, stride_dout, stride_y, stride_dy,
    K: tl.constexpr, K_POW2: tl.constexpr, WEIGHTED: tl.constexpr, NEED_DW: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_POW2)
    dw = tl.zeros((K_POW2,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < H
        d = tl.load(dout_ptr + t * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            row = tl.load(pos_ptr + t * K + j).to(tl.int64)
            if WEIGHTED:
                w = tl.load(w_ptr + t * K + j).to(dy_ptr.dtype.element_ty).to(tl.float32)
                tl.store(dy_ptr + row * stride_dy + cols, (d * w).to(dy_ptr.dtype.element_ty), mask=mask)
                if NEED_DW:
                    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
                    dw += tl.where(slots == j, tl.sum(d * y, axis=0), 0.0)
            else:
                tl.store(dy_ptr + row * stride_dy + cols, d.to(dy_ptr.dtype.element_ty), mask=mask)
    if NEED_DW:
        tl.store(dw_ptr + t * K + slots, dw.to(dw_ptr.dtype.element_ty), mask=slots < K)


def _check(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> tuple[int, int]:
    """(tokens, k) of a combine; refuses operands that do not fit."""
    if y.ndim != 2 or y.stride(1) != 1 or pos.ndim != 2 or pos.numel() > y.shape[0]:
        raise ValueError(f"combine_rows: y {tuple(y.shape)} (rows contiguous) and pos {tuple(pos.shape)} [tokens, k] "
                         "must hold a row for every (token, slot)")  # fmt: skip
    if weights is not None and (tuple(weights.shape) != tuple(pos.shape) or not weights.is_contiguous()):
        raise ValueError(f"combine_rows: weights {tuple(weights.shape)} must be contiguous, as pos {tuple(pos.shape)}")
    return pos.shape


def combine_rows(
    y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """`out [tokens, H]`: `out[t] = sum_j bf16(y[pos[t, j]] * bf16(weights[t, j]))` (or the plain sum of the rows,
    `weights` None) in fp32, in slot order, rounded to `out_dtype`. `pos [tokens, k]`: the row of `y` of each slot
    (`y` may hold other rows, such as a padded layout's padding, which are not read)."""
    tokens, k = _check(y, pos, weights)
    h = y.shape[1]
    out = torch.empty(tokens, h, device=y.device, dtype=out_dtype)
    if out.numel():
        pos = pos.contiguous()
        _combine_kernel[(tokens, triton.cdiv(h, BLOCK_H))](
            y, weights if weights is not None else pos, pos, out, h, y.stride(0), out.stride(0),
            K=k, WEIGHTED=weights is not None, BLOCK_H=BLOCK_H, num_warps=4,
        )  # fmt: skip
    return out


def combine_rows_backward(
    grad_out: torch.Tensor, y: torch.Tensor | None, pos: torch.Tensor, weights: torch.Tensor | None, need_dw: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(dy [rows, H], dw [tokens, k] or None)` for `combine_rows`' output gradient `grad_out [tokens, H]`: `dy` in
    `grad_out`'s dtype (the rows' gradient), `dw` in the weights' dtype (`y`, the forward's rows, read only for it)."""
    tokens, k = pos.shape
    h = grad_out.shape[1]
    dy = torch.empty(pos.numel(), h, device=grad_out.device, dtype=grad_out.dtype)
    need_dw = need_dw and weights is not None
    dw = torch.empty_like(weights) if need_dw else None
    if tokens and h:
        grad_out, pos = grad_out.contiguous(), pos.contiguous()
        y_arg = y if need_dw else grad_out
        _combine_backward_kernel[(tokens,)](
            grad_out, y_arg, weights if weights is not None else pos, pos, dy, dw if need_dw else dy,
            h, grad_out.stride(0), y_arg.stride(0), dy.stride(0),
            K=k, K_POW2=triton.next_power_of_2(k), WEIGHTED=weights is not None, NEED_DW=need_dw, BLOCK_H=BLOCK_H,
            num_warps=4,
        )  # fmt: skip
    elif need_dw:
        dw.zero_()
    return dy, dw
