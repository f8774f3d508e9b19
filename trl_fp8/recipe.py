"""`BlockwiseRecipe`: the block shape and scale rounding of the FP8 weights a checkpoint stores and a weight sync
pushes, in one frozen object passed down the export and sync path (instead of a loose `power_of_two_scales` flag)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_fp8.config import BLOCK
from trl_fp8.quantization import FP8_DTYPE, quantize_blocks

__all__ = ["DEFAULT_RECIPE", "BlockwiseRecipe"]


@dataclass(frozen=True)
class BlockwiseRecipe:
    """Weights in `block x block` tiles, one float32 `scale_inv` per tile (vLLM's and transformers' block FP8), the
    scales rounded down to powers of two when `power_of_two_scales`."""

    block: int = BLOCK
    power_of_two_scales: bool = False

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(q [N, K], scale_inv [N/block, K/block])` of a 2-D weight."""
        return quantize_blocks(weight, (self.block, self.block), power_of_two_scales=self.power_of_two_scales)

    def quantize_experts(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(q [E, N, K], scale_inv [E, N/block, K/block])` of a stacked `[E, N, K]` weight, expert by expert (no
        block spans two experts, so the bits are those of the whole stack; the temporaries are one expert's)."""
        e, n, k = weight.shape
        q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        scale = torch.empty((e, n // self.block, k // self.block), dtype=torch.float32, device=weight.device)
        with torch.no_grad():
            for i in range(e):
                q[i], scale[i] = self.quantize(weight[i].detach())
        return q, scale


DEFAULT_RECIPE = BlockwiseRecipe()
"""128x128 blocks, scales as computed: what vLLM's and DeepSeek's block-FP8 checkpoints hold."""
