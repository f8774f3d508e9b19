"""A BF16 linear layer (the lm_head) with the engine's kernel forward.

In its batch-invariant mode vLLM multiplies unquantized weights with its own Triton matmul (a fixed tile per
weight shape, whatever the number of rows) instead of cuBLAS; the trainer calls it for the logits. The backward is
two ordinary matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# kernel(x [M, K], weight [N, K]) -> [M, N] (vLLM's `linear_batch_invariant`)
LinearKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def reference_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` in float32, rounded once."""
    return (x.float() @ weight.float().t()).to(x.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, kernel):
        ctx.save_for_backward(x, weight)
        return kernel(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def linear(x: torch.Tensor, weight: torch.Tensor, kernel: LinearKernel = reference_linear) -> torch.Tensor:
    """`kernel`'s `x @ weight.T`; gradients to x and weight."""
    return _Linear.apply(x, weight, kernel)
