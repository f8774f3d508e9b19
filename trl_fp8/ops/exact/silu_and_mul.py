"""The gated MLP's `silu(gate) * up`, with the engine's kernel forward.

The engine computes the product in one kernel from the merged gate/up projection (`[..., 2 * I]`: gate first) and
rounds it to the model's dtype before quantizing it for `down_proj`; the trainer does the same, where its own fused
`quantize_swiglu` would quantize the unrounded product.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# kernel(gate_up [..., 2 * I]) -> [..., I] (vLLM's `SiluAndMul`)
SiluAndMulKernel = Callable[[torch.Tensor], torch.Tensor]


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the halves of `gate_up`, in float32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, kernel):
        ctx.save_for_backward(gate_up)
        return kernel(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        g = grad.float()
        grad_gate = g * up * sig * (1 + gate * (1 - sig))
        grad_up = g * gate * sig
        return torch.cat([grad_gate, grad_up], dim=-1).to(gate_up.dtype), None


def silu_and_mul(gate_up: torch.Tensor, kernel: SiluAndMulKernel = reference_silu_and_mul) -> torch.Tensor:
    """`kernel(gate_up)`'s values; gradients to `gate_up`."""
    return _SiluAndMul.apply(gate_up, kernel)
