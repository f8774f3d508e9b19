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

Passes over memory, per layer and step: the forward quantizes `x` once into both layouts it needs (groups along K
for FProp, along tokens for WGrad) and saves the FP8 `x.T` for WGrad instead of the BF16 `x` (half the bytes);
layers that read the same input (q/k/v, gate/up) share that one quantization. The backward quantizes `dy` once into
both of its layouts, and re-quantizes the weight in DGrad's column-major layout (the quantizer is deterministic, so
these are the forward's FP8 values bit for bit; no second FP8 copy of the weight outlives the forward).
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from torch import nn

from trl_fp8.config import BLOCKWISE, FP8LinearConfig
from trl_fp8.distributed import gather_quantized, is_sharded
from trl_fp8.nn.weight_cache import (  # noqa: F401 (the cache's functions lived here before: the trainer imports them)
    FP8WeightCacheMixin,
    cache_hit,
    cached_fp8_layers,
    caches_now,
    fp8_weight_cache_bytes,
    invalidate_fp8_weights,
    is_own_parameter,
    release_fp8_weight_caches,
    tensor_bytes,
    weight_cache_key,
)
from trl_fp8.ops import select_backend_name, select_ops
from trl_fp8.ops.library import traceable
from trl_fp8.quantization import QuantizedAct

__all__ = ["FP8Linear", "fp8_weight_cache_bytes", "invalidate_fp8_weights", "release_fp8_weight_caches"]


class FP8Weight:
    """One weight's FP8 values and scales as FProp uses them: `q` `[N, K]` row-major, `scale_inv` `[N/128, K/128]`."""

    cached = False  # whether a layer cache holds it (so a backward may keep it at no cost)

    def __init__(self, weight: torch.Tensor, ops, power_of_two_scales: bool):
        self.ops, self.power_of_two_scales = ops, power_of_two_scales
        with torch.no_grad():
            self.q, self.scale_inv = ops.quantize_weight(weight.detach(), power_of_two_scales=power_of_two_scales)

    @classmethod
    def of(cls, q: torch.Tensor, scale_inv: torch.Tensor, ops, power_of_two_scales: bool) -> FP8Weight:
        """An FP8 weight already quantized (one expert's slice of an `FP8Experts` weight)."""
        weight = object.__new__(cls)
        weight.ops, weight.power_of_two_scales, weight.q, weight.scale_inv = ops, power_of_two_scales, q, scale_inv
        return weight

    def __deepcopy__(self, memo):  # `ops` is a module, which cannot be copied: share it (a deep-copied model works)
        clone = object.__new__(FP8Weight)
        clone.ops, clone.power_of_two_scales, clone.cached = self.ops, self.power_of_two_scales, self.cached
        clone.q, clone.scale_inv = copy.deepcopy(self.q, memo), copy.deepcopy(self.scale_inv, memo)
        return clone

    def __getstate__(self):  # pickling (torch.save of a whole model): `ops`, a module, goes by its name
        return {**vars(self), "ops": self.ops.__name__}

    def __setstate__(self, state):
        import importlib

        self.__dict__.update(state, ops=importlib.import_module(state["ops"]))


class InputEntry:
    """A value computed from one input tensor, kept for the next layer that reads the very same tensor (the FP8
    operands of q/k/v's or gate/up's shared input; the outputs of sibling layers not called yet). Matched on the
    tensor object (a weak reference, so a freed tensor whose memory is reused never matches) and a key (its version
    counter for in-place changes, and whatever else the value depends on). The value is let go as soon as that tensor
    is freed, from whichever thread frees it (autograd's, during backward)."""

    __slots__ = ("ref", "key", "value")

    def __init__(self, x: torch.Tensor, key: tuple, value):
        self.key, self.value = key, value
        self.ref = weakref.ref(x, self.drop)

    def drop(self, _ref=None) -> None:
        self.value = None

    def holds(self, x: torch.Tensor, key: tuple) -> bool:
        """Whether this entry still holds a value for `x` as it is now (`key`)."""
        return self.value is not None and self.ref() is x and self.key == key


_last_input = threading.local()  # one entry per thread: concurrent forwards never see each other's


def forget_quantized_input() -> None:
    """Drop the shared-input entry (benchmarks that feed one tensor to a layer repeatedly call this per step)."""
    entry = getattr(_last_input, "entry", None)
    if entry is not None:
        entry.drop()
        _last_input.entry = None


def _quantize_input(x: torch.Tensor, x2d: torch.Tensor, ops, pow2: bool, cols: bool) -> QuantizedAct:
    cacheable = not (torch.compiler.is_compiling() or x.is_inference() or torch.is_inference_mode_enabled())
    if cacheable:
        key = (x._version, ops, pow2)
        entry = getattr(_last_input, "entry", None)
        if entry is not None and entry.holds(x, key) and (entry.value.qt is not None or not cols):
            return entry.value
        forget_quantized_input()  # release the previous operands now, not when the garbage collector runs
    act = ops.quantize_act(x2d, rows=True, cols=cols, power_of_two_scales=pow2)
    if cacheable:
        _last_input.entry = InputEntry(x, key, act)
    return act


class _BlockwiseFP8Matmul(torch.autograd.Function):
    """`y = x @ W.T` with FProp, DGrad and WGrad in FP8. With `siblings`, `W` is the row-wise concatenation of
    `weight` and the sibling weights (layers reading one input, `FP8LinearConfig.fuse_sibling_gemms`): one GEMM per
    pass for all of them, each weight getting its rows of the one WGrad result."""

    @staticmethod
    def forward(ctx, x, weight, fp8_weight: FP8Weight, grad_enabled: bool = True, *siblings):
        ops, pow2 = fp8_weight.ops, fp8_weight.power_of_two_scales
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        m = x2d.shape[0]
        # (grad mode is off inside forward, so the caller says whether a backward can follow)
        wgrad = grad_enabled and (ctx.needs_input_grad[1] or any(ctx.needs_input_grad[4:]))
        act = _quantize_input(x, x2d, ops, pow2, cols=wgrad)
        out = ops.gemm(act.q, act.scale_inv, fp8_weight.q, fp8_weight.scale_inv, True, x.dtype)[:m]
        # The weights are saved so DGrad can re-quantize them and so autograd rejects an in-place change before
        # backward. A sibling group's DGrad multiplies by the forward's FP8 weight when the layer cache holds it anyway
        # (so keeping it costs nothing), else re-quantizes the concatenated weights.
        ctx.dgrad_weight = fp8_weight if siblings and fp8_weight.cached else None
        ctx.save_for_backward(weight, *siblings, *((act.qt, act.scale_inv_t) if wgrad else ()))
        ctx.num_weights = 1 + len(siblings)
        ctx.ops, ctx.pow2, ctx.x_shape, ctx.x_dtype = ops, pow2, x.shape, x.dtype
        return out.reshape(*x.shape[:-1], fp8_weight.q.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        weights, saved_x = saved[: ctx.num_weights], saved[ctx.num_weights :]
        need_w = (ctx.needs_input_grad[1], *ctx.needs_input_grad[4:])
        grad_x, grad_ws = blockwise_backward(
            grad_out,
            weights,
            saved_x,
            ctx.ops,
            ctx.pow2,
            ctx.needs_input_grad[0],
            need_w,
            ctx.x_dtype,
            ctx.dgrad_weight,
        )
        ctx.dgrad_weight = None
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        return grad_x, grad_ws[0], None, None, *grad_ws[1:]


def blockwise_backward(
    grad_out, weights, saved_x, ops, pow2: bool, need_dx: bool, need_w, dx_dtype: torch.dtype, dgrad_weight=None
):
    """DGrad and WGrad of `y = x @ W.T` (`W` the row-wise stack of `weights`) in FP8, from the output gradient and
    the FP8 `x.T` the forward saved: `(dx [M, K] or None, [dW_i or None per weight])`. `dgrad_weight`: the
    forward's FP8 `W` to multiply by, else `W` is re-quantized in DGrad's layout."""
    n = grad_out.shape[-1]
    m = grad_out.numel() // n
    need_dw = any(need_w)
    grad_x = None
    grad_ws = [None] * len(weights)
    dy = ops.quantize_act(grad_out.reshape(-1, n), rows=need_dx, cols=need_dw, power_of_two_scales=pow2)
    if need_dx:
        # W's 128x128 blocks are the same for W and W.T: DGrad multiplies by the forward's FP8 values.
        if dgrad_weight is not None:
            w_q, w_s = dgrad_weight.q.t(), dgrad_weight.scale_inv.t()  # the GEMM lays it out as it needs
        else:
            w = weights[0] if len(weights) == 1 else torch.cat(weights)
            w_q, w_s = ops.quantize_weight(w.detach(), col_major=True, power_of_two_scales=pow2)
            w_q, w_s = w_q.t(), w_s.t()
        grad_x = ops.gemm(dy.q, dy.scale_inv, w_q, w_s, True, dx_dtype)[:m]
    if need_dw:
        xt_q, xt_s = saved_x
        grad_w = ops.gemm(dy.qt, dy.scale_inv_t, xt_q, xt_s, False, weights[0].dtype)
        # Row slices of one contiguous result: each weight's gradient is contiguous, with no copy.
        parts = grad_w.split([w.shape[0] for w in weights]) if len(weights) > 1 else (grad_w,)
        grad_ws = [g if need else None for g, need in zip(parts, need_w, strict=True)]
    return grad_x, grad_ws


class FP8Linear(FP8WeightCacheMixin, nn.Linear):
    """`nn.Linear` computing its forward and backward GEMMs in blockwise FP8.

    Created in place from an `nn.Linear` by `trl_fp8.convert_to_fp8` (the class is swapped, the module object
    is kept), so parameters, hooks, `state_dict` keys and PEFT wrappers see the very same module. The master weight
    stays in its own dtype (BF16 or FP32) and is what the optimizer updates.
    """

    fp8_config: FP8LinearConfig

    @classmethod
    def convert_(cls, module: nn.Linear, config: FP8LinearConfig) -> FP8Linear:
        """Turn `module` into an `FP8Linear` in place and return it."""
        if config.recipe != BLOCKWISE:
            raise ValueError(f"FP8Linear implements the blockwise recipe; got recipe={config.recipe!r}.")
        module.__class__ = cls
        module.fp8_config = config
        module._fp8_group = None  # (FP8SiblingGroup, index) when it runs as one GEMM with its siblings
        module._init_weight_cache()
        return module

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight `[N, K]` and its `weight_scale_inv` exactly as the forward pass multiplies them.

        This is what the vLLM weight sync and the exporter send, so rollouts run on the trainer's FP8 values.
        """
        weight = self.weight
        if is_sharded(weight):
            # FSDP2 between forwards: quantize from the dtype the forward sees (not the fp32 master) and gather the FP8
            # blocks (a collective: every rank asks, in the same order, as the exporter and the vLLM sync do).
            def quantize(w):
                fp8_weight = self._quantize(w)
                return fp8_weight.q, fp8_weight.scale_inv

            return gather_quantized(weight, quantize)
        with torch.no_grad():  # not a forward: the cache serves it whatever the caller's grad mode (cache_with_grad)
            fp8_weight = self._fp8_weight()
        return fp8_weight.q, fp8_weight.scale_inv

    def _cache_key(self) -> tuple:
        return weight_cache_key(self.weight, self._fp8_invalidations)

    def _quantize(self, w: torch.Tensor) -> FP8Weight:
        cfg = self.fp8_config
        return FP8Weight(w, select_ops(cfg, w.device), cfg.power_of_two_scales)

    def _fp8_weight(self) -> FP8Weight:
        w, cfg = self.weight, self.fp8_config
        if torch.compiler.is_compiling():
            # Inside a compiled graph the weight is quantized in the graph (the cache's pointer and version checks
            # would break it), and the ops are the backend's traceable form (`ops.library.traceable`), chosen once
            # while tracing (`select_backend_name`).
            ops = traceable(select_backend_name(cfg.backend, w.device))
            return FP8Weight(w, ops, cfg.power_of_two_scales)
        if not is_own_parameter(self, "weight", w):
            # A weight computed at each call (PEFT's `target_parameters` parametrizes it as a new `W + BA` tensor per
            # forward): its address, version and the step count cannot tell one adapter state from the next (a new
            # tensor at a reused address, an adapter written in place), so it is quantized fresh and never cached.
            return self._quantize(w)
        keep = caches_now(cfg, w)
        key = self._cache_key()
        if (hit := cache_hit(self._fp8_weight_cache, key)) is not None:
            if keep:
                return hit
            # A forward recording gradients with `cache_with_grad=False`: the copy's last use; the layer lets go of it,
            # and the backward does not keep it (`cached` False), so the training step's peak holds no FP8 copies.
            self.release_cache()
            return FP8Weight.of(hit.q, hit.scale_inv, hit.ops, hit.power_of_two_scales)
        if self._fp8_group is not None and keep:
            # One cached copy per group: its stack, of which this layer's cache holds a view (a copy of its own
            # beside the stack would hold these bytes twice).
            self._fp8_group[0].fp8_weight()
            return self._fp8_weight_cache[1]
        fp8_weight = self._quantize(w)
        fp8_weight.cached = keep
        self._fp8_weight_cache = (key, fp8_weight) if keep else None
        return fp8_weight

    def _reset_weight_cache(self) -> None:
        self._fp8_weight_cache: tuple[tuple, FP8Weight] | None = None

    def _cached_fp8_tensors(self) -> tuple[torch.Tensor, ...]:
        """In a sibling group: this layer's rows of the group's stacked copy."""
        cached = self._fp8_weight_cache
        return () if cached is None else (cached[1].q, cached[1].scale_inv)

    def release_cache(self) -> int:
        """Let go of the cached FP8 weight without invalidating it (`FP8WeightCacheMixin.release_cache`). In a
        sibling group, the whole stacked copy goes, and its bytes are returned (every sibling's cache views it, so it
        is freed only with all of them)."""
        if self._fp8_group is not None:
            return self._fp8_group[0].release_cache()
        return super().release_cache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._fp8_group
        out = group[0].forward_member(group[1], x) if group is not None else None
        if out is None:
            out = _BlockwiseFP8Matmul.apply(x, self.weight, self._fp8_weight(), torch.is_grad_enabled())
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_config.recipe}"
