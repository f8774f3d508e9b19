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
scales (1 byte per parameter, shared with the weight cache). DGrad needs those FP8 values column-major; on the GPU
the deterministic quantizer writes that layout directly (bit-identical, cheaper than transposing FP8 bytes), once
per weight version when the cache is on. Token counts that are not multiples of 128 are zero-padded for WGrad;
zeros change no group's amax, so the padding is exact.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .config import FP8LinearConfig
from .ops import select_ops

__all__ = ["FP8Linear", "invalidate_fp8_weights"]

_ROWS = 128  # WGrad groups run along the token dim

# When a cached FP8 weight is stale. Fused optimizers (AdamW(fused=True), the transformers default) update parameters
# without bumping their autograd version counter, and writes through `.data` (PEFT's merge, TRL's reference-model
# sync) bypass it too, so `_version` alone cannot tell. A trainable weight's key therefore includes the process-wide
# count of optimizer steps (it is requantized once per step); a frozen weight (a LoRA base, the reference model) is
# quantized once and only an explicit invalidation (`FP8Linear.invalidate`, `invalidate_fp8_weights`, done for you on
# `load_state_dict` and on PEFT merge/unmerge) or a new tensor behind the parameter makes it quantize again.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[0] % _ROWS
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class FP8Weight:
    """One weight's FP8 values and scales as the GEMMs use them: `q` `[N, K]` and `scale_inv` `[N/128, K/128]`.

    The DGrad layout of the same values is made on first use and kept, so a cached `FP8Weight` serves every
    micro-batch until the optimizer changes the weight.
    """

    def __init__(self, weight: torch.Tensor, ops, power_of_two_scales: bool):
        self.ops, self.power_of_two_scales = ops, power_of_two_scales
        self._weight = weight.detach()
        with torch.no_grad():
            self.q, self.scale_inv = ops.quantize_weight(self._weight, power_of_two_scales=power_of_two_scales)
        self._dgrad = None

    def dgrad_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._dgrad is None:
            with torch.no_grad():
                self._dgrad = self.ops.quantize_weight_dgrad(
                    self._weight, power_of_two_scales=self.power_of_two_scales
                )
        return self._dgrad


class _BlockwiseFP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, fp8_weight: FP8Weight):
        ops, pow2 = fp8_weight.ops, fp8_weight.power_of_two_scales
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        m = x2d.shape[0]
        x_q, x_s = ops.quantize_act(_pad_rows(x2d), power_of_two_scales=pow2)
        out = ops.gemm(x_q, x_s, fp8_weight.q, fp8_weight.scale_inv, True, x.dtype)[:m]
        # `weight` is saved only so autograd rejects an in-place change between forward and backward.
        ctx.save_for_backward(x, weight)
        ctx.fp8_weight = fp8_weight
        return out.reshape(*x.shape[:-1], fp8_weight.q.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        fp8_weight = ctx.fp8_weight
        ops, pow2 = fp8_weight.ops, fp8_weight.power_of_two_scales
        n, k = fp8_weight.q.shape
        dy = _pad_rows(grad_out.reshape(-1, n).contiguous())
        m = x.numel() // k
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_s = ops.quantize_act(dy, power_of_two_scales=pow2)
            # W's 128x128 blocks are the same for W and W.T: DGrad multiplies by the forward's FP8 values.
            w_q, w_s = fp8_weight.dgrad_operand()
            grad_x = ops.gemm(dy_q, dy_s, w_q.t(), w_s.t(), True, x.dtype)[:m].reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dyt_q, dyt_s = ops.quantize_act_t(dy, power_of_two_scales=pow2)
            xt_q, xt_s = ops.quantize_act_t(_pad_rows(x.reshape(-1, k)), power_of_two_scales=pow2)
            grad_w = ops.gemm(dyt_q, dyt_s, xt_q, xt_s, False, weight.dtype)
        return grad_x, grad_w, None


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
        module._fp8_invalidations = 0
        _watch_peft_merges()
        return module

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight `[N, K]` and its `weight_scale_inv` exactly as the forward pass multiplies them.

        This is what the vLLM weight sync and the exporter send, so rollouts run on the trainer's FP8 values.
        """
        fp8_weight = self._fp8_weight()
        return fp8_weight.q, fp8_weight.scale_inv

    def _cache_key(self) -> tuple:
        w = self.weight
        steps = _optimizer_steps if w.requires_grad else None  # frozen weights do not change with optimizer steps
        return (w.data_ptr(), w._version, w.device, w.dtype, self._fp8_invalidations, steps)

    def _fp8_weight(self) -> FP8Weight:
        w, cfg = self.weight, self.fp8_config
        key = self._cache_key()
        cached = self._fp8_weight_cache
        # Tensors made under inference_mode cannot be saved for backward: re-quantize outside it.
        if (
            cached is not None
            and cached[0] == key
            and (torch.is_inference_mode_enabled() or not cached[1].q.is_inference())
        ):
            return cached[1]
        fp8_weight = FP8Weight(w, select_ops(cfg, w.device), cfg.power_of_two_scales)
        self._fp8_weight_cache = (key, fp8_weight) if cfg.cache_quantized_weight else None
        return fp8_weight

    def invalidate(self) -> None:
        """Forget the cached FP8 weight: the next forward quantizes the weight as it is now.

        Call it (or :func:`invalidate_fp8_weights` on the model) after writing a weight in place behind autograd's
        back, e.g. `layer.weight.data.add_(...)` or a custom kernel. Optimizer steps, `load_state_dict`, PEFT
        merge/unmerge and assigning a new tensor to the parameter invalidate on their own.
        """
        self._fp8_weight_cache = None
        self._fp8_invalidations += 1

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.invalidate()  # whether it copied in place or assigned: do not rely on what the key happens to see

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _BlockwiseFP8Matmul.apply(x, self.weight, self._fp8_weight())
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_config.recipe}"


def invalidate_fp8_weights(model: nn.Module) -> int:
    """Invalidate the cached FP8 weight of every `FP8Linear` in `model`; returns how many there were."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for layer in layers:
        layer.invalidate()
    return len(layers)


_peft_watched = False


def _watch_peft_merges() -> None:
    """Make PEFT's `merge`/`unmerge` invalidate an FP8 base layer's cache.

    PEFT merges LoRA into the base weight with `weight.data += delta` (no version bump, same storage), so nothing
    the cache key sees changes; `merge_and_unload()` would keep serving, exporting and syncing the unmerged weight.
    PEFT has no hook for merges, so each tuner layer class's own `merge`/`unmerge` is wrapped once per process.
    """
    global _peft_watched
    if _peft_watched:
        return
    _peft_watched = True
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no PEFT, no merges
        return

    def wrap(method):
        @functools.wraps(method)  # also sets __wrapped__, which marks the method as done
        def merge_or_unmerge(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            finally:
                base = self.get_base_layer()
                if isinstance(base, FP8Linear):
                    base.invalidate()

        return merge_or_unmerge

    pending, seen = [BaseTunerLayer], set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        for name in ("merge", "unmerge"):
            method = cls.__dict__.get(name)
            if callable(method) and not hasattr(method, "__wrapped__"):
                setattr(cls, name, wrap(method))
