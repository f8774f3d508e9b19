"""The gated MLP's `down_proj(silu(gate) * up)` with the activation fused into `down_proj`'s input quantization.

Eager PyTorch runs `silu`, the product and `down_proj`'s quantization of it as three passes, writes the BF16 product
`h` and keeps `silu(gate)` for backward. Here one kernel (`kernels/swiglu_quant.py`; the reference quantizer when
emulating) forms `h` from gate and up and writes only its FP8 operands, and backward recomputes `silu(gate)` from the
saved gate (one elementwise pass) instead of keeping it: per layer one `[tokens, intermediate]` BF16 tensor less
held for backward, and 6 bytes per element moved instead of 14 in the forward.

The math is the unfused FP8 path's: `h` is formed with eager's roundings, FProp, DGrad and WGrad are
`nn.linear.blockwise_backward`'s, and gate and up get their gradients from the same aten ops autograd would run
(`silu_backward`, the product's two halves). Only the MLP's forward changes (an instance attribute, which pickles
with the model), and only where the MLP's class computes exactly `down_proj(act_fn(gate_proj(x)) * up_proj(x))`
(its `forward`'s code is that one expression; anything more, such as Falcon-H1's multipliers or a `swiglu_limit`
clamp, is refused with the class named), `act_fn` is SiLU and `down_proj` a plain blockwise `FP8Linear`. At each
call, anything that must see `h` or run `down_proj`'s own forward (forward or backward hooks, a PEFT adapter or
accelerate hook put on `down_proj` later, FSDP2 shards, `torch.compile`) sends the call down the eager path.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from trl_fp8.distributed import is_sharded
from trl_fp8.nn.linear import FP8Linear, FP8Weight, blockwise_backward

__all__ = ["fuse_swiglu", "is_fused_swiglu", "swiglu_problem"]

GATED_MLP_LAYERS = ("gate_proj", "up_proj", "down_proj")
# The one computation the fused forward replaces, as `ast.unparse` writes it ({x}: the forward's input).
_PLAIN_GATED_MLP = "self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))"


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
    # Exact classes only: a subclass may compute something else under the same name.
    from transformers.activations import SiLUActivation

    return type(act_fn) in (nn.SiLU, SiLUActivation) and "forward" not in vars(act_fn)


@functools.cache
def _is_plain_gated_forward(forward) -> bool:
    """Whether `forward` (a function) is `def forward(self, x): return down_proj(act_fn(gate_proj(x)) * up_proj(x))`,
    or the same through one local variable, and nothing else: read from its source, so any extra step (a
    multiplier, a clamp, a dropout, a norm) makes it not plain."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):  # no source to read (built at run time): cannot tell, so not plain
        return False
    fn = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(fn, ast.FunctionDef) or fn.decorator_list:
        return False
    args = fn.args
    if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg or args.defaults or len(args.args) != 2:
        return False
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    call = _PLAIN_GATED_MLP.format(x=args.args[1].arg)
    lines = [ast.unparse(statement) for statement in body]
    if lines == [f"return {call}"]:
        return True
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[0].targets[0], ast.Name):
        local = body[0].targets[0].id
        return lines == [f"{local} = {call}", f"return {local}"]
    return False


def swiglu_problem(mlp: nn.Module) -> str | None:
    """Why `mlp` cannot run its activation fused into `down_proj`'s quantization, or None."""
    cls = type(mlp).__name__
    parts = [getattr(mlp, name, None) for name in GATED_MLP_LAYERS]
    if any(not isinstance(p, nn.Module) for p in parts):
        return f"{cls} is not a gated MLP with gate_proj, up_proj, down_proj layers"
    if is_fused_swiglu(mlp):
        return f"{cls} is fused already"
    if "forward" in vars(mlp):
        return f"{cls}'s forward is replaced by another one"
    if not _is_plain_gated_forward(type(mlp).forward):
        return f"{cls}.forward computes more than down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    if not _is_silu(getattr(mlp, "act_fn", None)):
        return f"{cls}'s activation is {type(getattr(mlp, 'act_fn', None)).__name__}, not SiLU"
    if type(parts[2]) is not FP8Linear:
        return f"{cls}'s down_proj is not a blockwise FP8Linear"
    return None


def _down_proj_must_run_itself(down: nn.Module) -> bool:
    """Whether something must see `down_proj`'s input or run its own forward: hooks (its own or global ones),
    another forward put on it, a compiled region, FSDP2 shards."""
    from torch.nn.modules import module as torch_module

    global_hooks = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                    "_global_backward_pre_hooks")  # fmt: skip
    return (
        type(down) is not FP8Linear
        or bool(down._forward_hooks or down._forward_pre_hooks or down._backward_hooks or down._backward_pre_hooks)
        or any(getattr(torch_module, name, None) for name in global_hooks)
        or "forward" in vars(down)  # accelerate's hooks replace a module's forward
        or torch.compiler.is_compiling()
        or is_sharded(down.weight)
    )


def _fused_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    down = mlp.down_proj
    if _down_proj_must_run_itself(down) or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return down(mlp.act_fn(gate) * up)
    out = _SwiGLUFP8Down.apply(gate, up, down.weight, down._fp8_weight(), torch.is_grad_enabled())
    return out if down.bias is None else out + down.bias


class FusedSwiGLUForward:
    """The fused forward of one MLP, set as its `forward` attribute. A plain object of this module (not a bound
    method of a function the MLP's class lacks), so `torch.save` / `torch.load` and `copy.deepcopy` of a whole model
    carry it, bound to the copy's MLP."""

    def __init__(self, mlp: nn.Module):
        self.mlp = mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_forward(self.mlp, x)


def is_fused_swiglu(mlp: nn.Module) -> bool:
    """Whether `mlp` runs the fused forward."""
    return isinstance(vars(mlp).get("forward"), FusedSwiGLUForward)


def fuse_swiglu(model: nn.Module) -> list[str]:
    """Give every gated MLP of `model` that `swiglu_problem` accepts the fused forward; returns their names."""
    fused = []
    for name, module in model.named_modules():
        if swiglu_problem(module) is None:
            module.forward = FusedSwiGLUForward(module)
            fused.append(name)
    return fused
