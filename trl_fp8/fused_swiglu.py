"""The gated MLP's `down_proj(silu(gate) * up)` with the activation fused into `down_proj`'s input quantization.

Eager PyTorch runs `silu`, the product and `down_proj`'s quantization of it as three passes, writes the BF16 product
`h` and keeps `silu(gate)` for backward. Here one kernel (`kernels/swiglu_quant.py`; the reference quantizer when
emulating) forms `h` from gate and up and writes only its FP8 operands, and backward recomputes `silu(gate)` from the
saved gate (one elementwise pass) instead of keeping it: per layer one `[tokens, intermediate]` BF16 tensor less
held for backward, and 6 bytes per element moved instead of 14 in the forward.

The math is the unfused FP8 path's: `h` is formed with eager's roundings, FProp, DGrad and WGrad are
`fp8_linear.blockwise_backward`'s, and gate and up get their gradients from the same aten ops autograd would run
(`silu_backward`, the product's two halves). Only the MLP's forward changes (an instance attribute), and only where
`down_proj` is a plain blockwise `FP8Linear` with `act_fn` SiLU; at each call, anything that must see `h` or run
`down_proj`'s own forward (forward hooks, a PEFT adapter or accelerate hook put on `down_proj` later, FSDP2 shards,
`torch.compile`) sends the call down the eager path.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .fp8_linear import FP8Linear, FP8Weight, blockwise_backward, is_sharded

__all__ = ["fuse_swiglu", "swiglu_problem"]


class _SwiGLUFP8Down(torch.autograd.Function):
    """`down(silu(gate) * up)` with `down` a blockwise FP8 linear: FProp on the fused quantization of the product."""

    @staticmethod
    def forward(ctx, gate, up, weight, fp8_weight: FP8Weight, grad_enabled: bool):
        ops, pow2 = fp8_weight.ops, fp8_weight.power_of_two_scales
        i = gate.shape[-1]
        gate2d, up2d = gate.reshape(-1, i), up.reshape(-1, i)
        m = gate2d.shape[0]
        wgrad = grad_enabled and ctx.needs_input_grad[2]
        act = ops.quantize_swiglu(gate2d, up2d, rows=True, cols=wgrad, power_of_two_scales=pow2)
        out = ops.gemm(act.q, act.scale_inv, fp8_weight.q, fp8_weight.scale_inv, True, gate.dtype)[:m]
        ctx.save_for_backward(gate, up, weight, *((act.qt, act.scale_inv_t) if wgrad else ()))
        ctx.ops, ctx.pow2 = ops, pow2
        return out.reshape(*gate.shape[:-1], fp8_weight.q.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight, *saved_h = ctx.saved_tensors
        need_dh = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h, (grad_w,) = blockwise_backward(
            grad_out, (weight,), saved_h, ctx.ops, ctx.pow2, need_dh, (ctx.needs_input_grad[2],), gate.dtype
        )
        grad_gate = grad_up = None
        if need_dh:
            grad_h = grad_h.reshape(gate.shape)
            # What autograd runs for `silu(gate) * up`: the product's halves, then silu's backward.
            if ctx.needs_input_grad[1]:
                grad_up = grad_h * F.silu(gate)
            if ctx.needs_input_grad[0]:
                grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
        return grad_gate, grad_up, grad_w, None, None


def _is_silu(act_fn) -> bool:
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ in ("SiLUActivation", "SiLU")


def swiglu_problem(mlp: nn.Module) -> str | None:
    """Why `mlp` cannot run its activation fused into `down_proj`'s quantization, or None."""
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if any(not isinstance(p, nn.Module) for p in parts):
        return "not a gated MLP (gate_proj, up_proj, down_proj)"
    if not _is_silu(getattr(mlp, "act_fn", None)):
        return f"its activation is {type(getattr(mlp, 'act_fn', None)).__name__}, not SiLU"
    if type(parts[2]) is not FP8Linear:
        return "down_proj is not a plain FP8Linear"
    if "forward" in mlp.__dict__:
        return "its forward is already replaced"
    return None


def _fused_forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    down = self.down_proj
    if (
        type(down) is not FP8Linear
        or down._forward_hooks
        or down._forward_pre_hooks
        or "forward" in down.__dict__  # accelerate's hooks replace a module's forward
        or torch.compiler.is_compiling()
        or is_sharded(down.weight)
        or gate.stride(-1) != 1
        or up.stride(-1) != 1
    ):
        return down(self.act_fn(gate) * up)
    out = _SwiGLUFP8Down.apply(gate, up, down.weight, down._fp8_weight(), torch.is_grad_enabled())
    return out if down.bias is None else out + down.bias


def fuse_swiglu(model: nn.Module) -> list[str]:
    """Give every gated MLP of `model` whose `down_proj` is FP8 the fused forward; returns their names."""
    fused = []
    for name, module in model.named_modules():
        if swiglu_problem(module) is None:
            module.forward = types.MethodType(_fused_forward, module)
            fused.append(name)
    return fused
