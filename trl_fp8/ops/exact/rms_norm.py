"""RMSNorm, alone and after the residual add, with the engine's kernel forward.

The engine normalizes the first layer's input alone and every later one together with the residual add (vLLM's
`fused_add_rms_norm`: the sum rounded to the model's dtype, which is also the next residual, then normalized).
Hugging Face's decoder adds outside the norm; in exact mode the trainer calls the fused form where the engine does,
so the sum and the norm are the same launch and the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# kernel(x, weight, eps) -> y; with `residual=`, kernel(x, weight, eps, residual=r) -> (y, x + r), free to write
# into x and r (vLLM's does: they are clones here)
RMSNormKernel = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` in float32, rounded once at the end (vLLM's batch-invariant kernel)."""
    xf = x.float()
    inv_rms = 1.0 / torch.sqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def reference_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual), x + residual)`: the sum rounded to x's dtype, normalized in float32, rounded, then
    multiplied by the weight (vLLM's `fused_add_rms_norm`), called as vLLM's batch-invariant RMSNorm is."""
    total = x + residual
    sf = total.float()
    normed = (sf / torch.sqrt(sf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed * weight.to(x.dtype), total


def _rms_norm_grads(s: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor):
    """d/ds and d/dweight of `s / rms(s) * weight`, in float32."""
    sf = s.float()
    inv_rms = torch.rsqrt(sf.square().mean(-1, keepdim=True) + eps)
    u = grad.float() * weight.float()
    grad_s = inv_rms * (u - sf * inv_rms.square() * (u * sf).mean(-1, keepdim=True))
    grad_weight = (grad.float() * sf * inv_rms).reshape(-1, s.shape[-1]).sum(0)
    return grad_s, grad_weight


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, kernel):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernel(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = _rms_norm_grads(x, weight, ctx.eps, grad)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, kernel):
        normed, total = kernel(x.clone(), weight, eps, residual=residual.clone())
        ctx.save_for_backward(total, weight)
        ctx.eps = eps
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        return normed, total

    @staticmethod
    def backward(ctx, grad_normed, grad_total):
        total, weight = ctx.saved_tensors
        grad_s, grad_weight = _rms_norm_grads(total, weight, ctx.eps, grad_normed)
        if grad_total is not None:
            grad_s = grad_s + grad_total.float()
        return grad_s.to(ctx.x_dtype), grad_s.to(ctx.residual_dtype), grad_weight.to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: RMSNormKernel = reference_rms_norm):
    """`kernel(x, weight, eps)`'s values; gradients to x and weight."""
    return _RMSNorm.apply(x, weight, eps, kernel)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    kernel: RMSNormKernel = reference_add_rms_norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual), x + residual)` as `kernel` computes them (x and residual are left as they were);
    gradients to x, residual and weight through both outputs."""
    return _AddRMSNorm.apply(x, residual, weight, eps, kernel)
