"""`FP8Linear`: an `nn.Linear` whose three GEMMs run in blockwise FP8 (the Jet-RL unified precision flow).

The math, in one autograd function (`_BlockwiseFP8Matmul`), for `y = x @ W.T` with `x [M, K]`, `W [N, K]`:

======  ==========================  =========================================  ==================================
GEMM    result                      operand A (1x128 groups along the sum)     operand B
======  ==========================  =========================================  ==================================
FProp   y      = x  @ W.T   [M, N]  x, groups along K                          W, 128x128 blocks
DGrad   dx     = dy @ W     [M, K]  dy, groups along N                         W, the same 128x128 blocks
WGrad   dW     = dy.T @ x   [N, K]  dy.T, groups along M (tokens)              x.T, groups along M (tokens)
======  ==========================  =========================================  ==================================

All operands are float8_e4m3fn with float32 scales, accumulation is fp32, and results leave the layer in the
input's dtype (BF16) for `dx` and the master weight's dtype for `dW`: inter-op gradients stay BF16.

Saved for backward: the input `x` in its own (BF16) precision, as `nn.Linear` does, and the FP8 weight with its
scales (1 byte per parameter, shared with the weight cache), so the backward pass never re-quantizes `W`. Token
counts that are not multiples of 128 are zero-padded for WGrad; zeros change no group's amax, so the padding is
exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import FP8LinearConfig
from .ops import select_ops

__all__ = ["FP8Linear"]

_ROWS = 128  # WGrad groups run along the token dim


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[0] % _ROWS
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class _BlockwiseFP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_q, w_s, ops, pow2):
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        m = x2d.shape[0]
        x_q, x_s = ops.quantize_act(_pad_rows(x2d), power_of_two_scales=pow2)
        out = ops.gemm(x_q, x_s, w_q, w_s, True, x.dtype)[:m]
        ctx.save_for_backward(x, w_q, w_s)
        ctx.ops, ctx.pow2, ctx.weight_dtype = ops, pow2, weight.dtype
        return out.reshape(*x.shape[:-1], w_q.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w_q, w_s = ctx.saved_tensors
        ops, pow2 = ctx.ops, ctx.pow2
        n, k = w_q.shape
        dy = _pad_rows(grad_out.reshape(-1, n).contiguous())
        m = x.numel() // k
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_s = ops.quantize_act(dy, power_of_two_scales=pow2)
            # W's 128x128 blocks are the same for W and W.T, so DGrad reuses the forward's FP8 weight.
            grad_x = ops.gemm(dy_q, dy_s, w_q.t(), w_s.t(), True, x.dtype)[:m].reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dyt_q, dyt_s = ops.quantize_act_t(dy, power_of_two_scales=pow2)
            xt_q, xt_s = ops.quantize_act_t(_pad_rows(x.reshape(-1, k)), power_of_two_scales=pow2)
            grad_w = ops.gemm(dyt_q, dyt_s, xt_q, xt_s, False, ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None


class FP8Linear(nn.Linear):
    """`nn.Linear` computing its forward and backward GEMMs in blockwise FP8.

    Created in place from an `nn.Linear` by :func:`trl_fp8.convert_to_fp8` (the class is swapped, the module object
    is kept), so parameters, hooks, `state_dict` keys and PEFT wrappers see the very same module. The master weight
    stays in its own dtype (BF16 or FP32) and is what the optimizer updates.
    """

    fp8_config: FP8LinearConfig

    @classmethod
    def convert_(cls, module: nn.Linear, config: FP8LinearConfig) -> FP8Linear:
        """Turn `module` into an `FP8Linear` in place and return it."""
        if config.recipe != "blockwise":
            raise ValueError(f"FP8Linear implements the blockwise recipe; got recipe={config.recipe!r}.")
        module.__class__ = cls
        module.fp8_config = config
        module._fp8_weight_cache = None
        return module

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight and its `weight_scale_inv` as the forward pass uses them (cached until the weight changes).

        This is what the vLLM weight sync and the exporter send, so rollouts run on the trainer's exact FP8 values.
        """
        w = self.weight
        cfg = self.fp8_config
        key = (w.data_ptr(), w._version, w.device, w.dtype)
        cache = self._fp8_weight_cache
        if (
            cache is not None
            and cache[0] == key
            and not (cache[1].is_inference() and not torch.is_inference_mode_enabled())
        ):
            return cache[1], cache[2]
        ops = select_ops(cfg, w.device)
        with torch.no_grad():
            w_q, w_s = ops.quantize_weight(w.detach(), power_of_two_scales=cfg.power_of_two_scales)
        self._fp8_weight_cache = (key, w_q, w_s) if cfg.cache_quantized_weight else None
        return w_q, w_s

    def clear_fp8_cache(self) -> None:
        self._fp8_weight_cache = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.fp8_config
        w_q, w_s = self.quantized_weight()
        ops = select_ops(cfg, x.device)
        out = _BlockwiseFP8Matmul.apply(x, self.weight, w_q, w_s, ops, cfg.power_of_two_scales)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_config.recipe}"
