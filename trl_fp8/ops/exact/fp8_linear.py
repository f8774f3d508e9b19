"""A block-FP8 linear layer's forward with the engine's kernels, its backward trl-fp8's own.

The engine quantizes each token's activation in 1x128 groups (vLLM's `QuantFP8`) and multiplies with DeepGEMM by
the FP8 weight and scales the trainer pushed; DeepGEMM gives each row the same bits at every M. The trainer calls
the same two kernels on the same FP8 weight for FProp; DGrad and WGrad are `FP8Linear`'s (`blockwise_backward`),
on the token-axis quantization of the input that this forward saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trl_fp8.nn.linear import FP8Weight, blockwise_backward

# kernel(x [M, K], weight_q [N, K], weight_scale_inv [N/128, K/128], out_dtype) -> [M, N]
FP8LinearKernel = Callable[..., torch.Tensor]


def reference_fp8_linear(x, weight_q, weight_scale_inv, out_dtype, *, ops=None, power_of_two_scales=False):
    """FProp as `FP8Linear` computes it (`ops`: its backend, default the exact emulation): x quantized in 1x128
    groups, times the 128x128-block weight, float32 sums."""
    from trl_fp8.ops import emulated

    ops = ops or emulated
    act = ops.quantize_act(x, rows=True, cols=False, power_of_two_scales=power_of_two_scales)
    return ops.gemm(act.q, act.scale_inv, weight_q, weight_scale_inv, True, out_dtype)[: x.shape[0]]


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, fp8_weight: FP8Weight, kernel):
        x2d = x.reshape(-1, x.shape[-1])
        out = kernel(x2d, fp8_weight.q, fp8_weight.scale_inv, x.dtype)
        wgrad = ctx.needs_input_grad[1]
        ops, pow2 = fp8_weight.ops, fp8_weight.power_of_two_scales
        if wgrad:  # WGrad's operand: x in 1x128 groups along the tokens, as FP8Linear saves it
            act = ops.quantize_act(x2d, rows=False, cols=True, power_of_two_scales=pow2)
            ctx.save_for_backward(weight, act.qt, act.scale_inv_t)
        else:
            ctx.save_for_backward(weight)
        ctx.ops, ctx.pow2, ctx.x_shape, ctx.x_dtype = ops, pow2, x.shape, x.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        weight, *saved_x = ctx.saved_tensors
        grad_x, (grad_w,) = blockwise_backward(
            grad_out, (weight,), saved_x, ctx.ops, ctx.pow2, ctx.needs_input_grad[0], (ctx.needs_input_grad[1],),
            ctx.x_dtype,
        )  # fmt: skip
        return (None if grad_x is None else grad_x.reshape(ctx.x_shape)), grad_w, None, None


def fp8_linear(x: torch.Tensor, layer, kernel: FP8LinearKernel | None = None) -> torch.Tensor:
    """`layer(x)` for an `FP8Linear` `layer`, FProp computed by `kernel` (default: the layer's own kernels) on the
    layer's FP8 weight; gradients to x and the layer's weight as `FP8Linear` computes them."""
    fp8_weight = layer._fp8_weight()
    if kernel is None:

        def kernel(x, q, s, dtype):
            return reference_fp8_linear(x, q, s, dtype, ops=fp8_weight.ops,
                                        power_of_two_scales=fp8_weight.power_of_two_scales)  # fmt: skip

    out = _FP8Linear.apply(x, layer.weight, fp8_weight, kernel)
    return out if layer.bias is None else out + layer.bias.to(out.dtype)
