"""The FP8 weight cache that `FP8Linear` and `FP8Experts` share: when a cached FP8 copy of a weight is stale, and the
methods that count, release and invalidate it (`FP8WeightCacheMixin`), on one layer or on a whole model.

When a cached FP8 weight is stale: fused optimizers (AdamW(fused=True), the transformers default) update parameters
without bumping their autograd version counter, and writes through `.data` (PEFT's merge, TRL's reference-model
sync) bypass it too, so `_version` alone cannot tell. A trainable weight's key therefore includes the process-wide
count of optimizer steps (it is requantized once per step); a frozen weight (a LoRA base, the reference model) is
quantized once and only an explicit invalidation (`invalidate`, `invalidate_fp8_weights`, done for you on
`load_state_dict` and on PEFT merge/unmerge) or a new tensor behind the parameter makes it quantize again. A weight
that is not the module's own parameter (PEFT's LoRA on `target_parameters` parametrizes it as a new `W + BA` at every
forward) is never cached: a new tensor may land at the address of the last one (`is_own_parameter`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = [
    "FP8WeightCacheMixin",
    "caches_now",
    "cached_fp8_layers",
    "fp8_weight_cache_bytes",
    "invalidate_fp8_weights",
    "release_fp8_weight_caches",
]

_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def optimizer_steps() -> int:
    """Optimizer steps taken in this process so far (any optimizer)."""
    return _optimizer_steps


def weight_cache_key(weight: torch.Tensor, invalidations: int) -> tuple:
    """What a cached FP8 copy of `weight` is valid for (see the module doc); `invalidations` counts the layer's
    explicit ones."""
    steps = _optimizer_steps if weight.requires_grad else None  # frozen weights do not change with optimizer steps
    return (weight.data_ptr(), weight._version, weight.device, weight.dtype, invalidations, steps)


def cache_hit(cached: tuple | None, key: tuple):
    """The FP8 weight of a `(key, FP8Weight)` cache entry if it is valid for `key` here, else None. Tensors made under
    inference_mode cannot be saved for backward, so outside it such an entry is re-quantized."""
    if cached is None or cached[0] != key:
        return None
    return cached[1] if torch.is_inference_mode_enabled() or not cached[1].q.is_inference() else None


def caches_now(config, weight: torch.Tensor) -> bool:
    """Whether a layer with `config` (`FP8LinearConfig`) keeps the FP8 copy of `weight` that this call quantizes:
    never without the cache; with `cache_with_grad=False`, not in a forward that records gradients for `weight`
    (a training micro-batch), so that a training step's memory peak holds no FP8 copies."""
    if not config.cache_quantized_weight:
        return False
    return config.cache_with_grad or not (torch.is_grad_enabled() and weight.requires_grad)


def is_own_parameter(module: nn.Module, name: str, weight: torch.Tensor) -> bool:
    """Whether `weight` (what `getattr(module, name)` gave) is the module's own parameter `name`, and not a tensor
    computed from it (a parametrization: PEFT's LoRA on `target_parameters` makes `W + BA` anew at every forward).
    Only a module's own parameter may have its FP8 copy cached: `weight_cache_key` tells states of one tensor apart,
    not two tensors that happen to share an address."""
    return weight is module._parameters.get(name)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class FP8WeightCacheMixin:
    """The FP8 weight cache of an FP8 layer (an `nn.Module`): `_fp8_weight_cache`, whose form the layer decides
    (`_reset_weight_cache`, `_cached_fp8_tensors`), and `_fp8_invalidations`, the count its cache keys include."""

    _fp8_invalidations: int

    def _init_weight_cache(self) -> None:
        """Start with an empty cache (at conversion), and have PEFT's merges invalidate it."""
        self._reset_weight_cache()
        self._fp8_invalidations = 0
        _watch_peft_merges()

    def _reset_weight_cache(self) -> None:
        """Set `_fp8_weight_cache` to the empty cache."""
        raise NotImplementedError

    def _cached_fp8_tensors(self) -> Iterable[torch.Tensor]:
        """The FP8 values and scales the cache holds."""
        raise NotImplementedError

    def invalidate(self) -> None:
        """Forget the cached FP8 weights: the next forward quantizes the weights as they are now.

        Call it (or `invalidate_fp8_weights` on the model) after writing a weight in place behind autograd's
        back, e.g. `layer.weight.data.add_(...)` or a custom kernel. Optimizer steps, `load_state_dict`, PEFT
        merge/unmerge and assigning a new tensor to the parameter invalidate on their own.
        """
        self.release_cache()
        self._fp8_invalidations += 1

    def cache_bytes(self) -> int:
        """Bytes of the cached FP8 weights (values and scales); 0 when none is cached."""
        return tensor_bytes(*self._cached_fp8_tensors())

    def release_cache(self) -> int:
        """Let go of the cached FP8 weights without invalidating them: the next forward quantizes the unchanged
        weights to the same bits. Returns the bytes let go."""
        released = self.cache_bytes()
        self._reset_weight_cache()
        return released

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.invalidate()  # whether it copied in place or assigned: do not rely on what the key happens to see


def cached_fp8_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that cache FP8 weights (`FP8Linear`, `FP8Experts`)."""
    return [m for m in model.modules() if isinstance(m, FP8WeightCacheMixin)]


def fp8_weight_cache_bytes(model: nn.Module) -> int:
    """Bytes of the FP8 weights (values and scales) that the FP8 layers of `model` keep cached between calls."""
    return sum(layer.cache_bytes() for layer in cached_fp8_layers(model))


def release_fp8_weight_caches(model: nn.Module) -> int:
    """Let go of the cached FP8 weights of every FP8 layer in `model` (`release_cache`); returns the bytes.

    Colocated rollouts in sleep mode do it once the engine holds its copy of the weights: vLLM's KV cache wakes into
    that memory, and the first forward after the rollout quantizes each weight again (one read of the weights)."""
    return sum(layer.release_cache() for layer in cached_fp8_layers(model))


def invalidate_fp8_weights(model: nn.Module) -> int:
    """Invalidate the cached FP8 weights of every FP8 layer (`FP8Linear`, `FP8Experts`) in `model`; returns how many
    there were."""
    layers = cached_fp8_layers(model)
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
                if isinstance(base, FP8WeightCacheMixin):  # LoRA's `target_parameters` merges into FP8 experts
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
