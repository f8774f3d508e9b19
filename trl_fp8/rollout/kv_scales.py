"""FP8 KV-cache scales measured on the trainer's own forward passes.

vLLM's `kv_cache_dtype="fp8"` stores K and V as `x / k_scale` (and, on FP8 attention backends, feeds Q as
`q / q_scale`), one per-tensor scale per attention layer. vLLM no longer computes them itself (`calculate_kv_scales`
is gone); without checkpoint scales it uses 1.0, which wastes most of e4m3's range or clips. As NeMo RL does, the
trainer measures the amax of Q (after its norm and RoPE), K and V exactly as attention receives them, and pushes
`amax / 448` with every weight sync, so the rollout cache follows the policy as it trains.

The measurement sits in transformers' attention dispatch (`AttentionInterface`): a registered wrapper records the
amax and calls the model's original attention function, so the model's math is untouched. The running max is kept
on the device (no host sync per forward) and read once per weight sync.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

FP8_E4M3_MAX = 448.0
_OBSERVER_ATTR = "_trl_fp8_kv_observer"

__all__ = ["AttentionScaleObserver", "observe_prompts"]


def _original_attention(module: nn.Module, implementation: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"fp8_kv_cache cannot observe attention implementation {implementation!r} of {module}.")
    return eager


def _observed_attention(implementation: str) -> Callable:
    def attention(module, query, key, value, *args, **kwargs):
        observer = getattr(module, _OBSERVER_ATTR, None)
        if observer is not None and observer.enabled:
            observer.record(module, query, key, value)
        return _original_attention(module, implementation)(module, query, key, value, *args, **kwargs)

    return attention


class AttentionScaleObserver:
    """Records per-layer amax of the attention inputs of a transformers model and turns them into vLLM scales.

    Usage: `observer = AttentionScaleObserver(model)` (switches the model to an observed copy of its attention
    implementation), run forwards, then `observer.scales()` -> `{"model.layers.0.self_attn.k_scale": tensor, ...}`
    in the checkpoint names vLLM's loader maps onto its attention layers.
    """

    def __init__(self, model: nn.Module):
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        self.enabled = True
        self._amax: dict[str, torch.Tensor] = {}
        self._last_scales: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        for name, module in model.named_modules():
            if hasattr(module, "layer_idx") and hasattr(module, "k_proj") and hasattr(module, "config"):
                clean = name.replace(".base_layer", "").removeprefix("base_model.model.")
                self._names[id(module)] = clean
                setattr(module, _OBSERVER_ATTR, self)
        if not self._names:
            raise ValueError(
                f"fp8_kv_cache: found no attention layers (modules with k_proj and layer_idx) in "
                f"{type(model).__name__}; set fp8_kv_cache=False for this architecture."
            )
        implementation = model.config._attn_implementation or "sdpa"
        if implementation.startswith("trl_fp8_kv_observed_"):
            return  # already observed (a second observer takes over the modules)
        observed = f"trl_fp8_kv_observed_{implementation.replace('|', '_')}"
        AttentionInterface.register(observed, _observed_attention(implementation))
        mask_key = implementation if implementation in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"
        AttentionMaskInterface.register(observed, ALL_MASK_ATTENTION_FUNCTIONS[mask_key])
        model.set_attn_implementation(observed)
        if model.config._attn_implementation != observed:
            raise ValueError(
                f"fp8_kv_cache: {type(model).__name__} does not let its attention implementation be set at run time, "
                "so its K/V scales cannot be measured; set fp8_kv_cache=False."
            )

    @torch.no_grad()
    def record(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        prefix = self._names.get(id(module))
        if prefix is None:
            return
        for leaf, x in (("q_scale", query), ("k_scale", key), ("v_scale", value)):
            amax = x.detach().abs().amax().float()
            name = f"{prefix}.{leaf}"
            previous = self._amax.get(name)
            self._amax[name] = amax if previous is None else torch.maximum(previous, amax)

    @property
    def has_observations(self) -> bool:
        return bool(self._amax) or bool(self._last_scales)

    def scales(self, reset: bool = True) -> dict[str, torch.Tensor]:
        """`amax / 448` per layer and tensor since the last call (the previous scales where nothing ran since)."""
        if self._amax:
            fresh = {n: (a.clamp_min(1e-12) / FP8_E4M3_MAX).reshape(()) for n, a in self._amax.items()}
            self._last_scales = {**self._last_scales, **fresh}
        if reset:
            self._amax = {}
        return dict(sorted(self._last_scales.items()))


@torch.no_grad()
def observe_prompts(
    model: nn.Module, prompt_ids: list[list[int]], pad_token_id: int, micro_batch: int, device: torch.device | str
) -> None:
    """Run `prompt_ids` through `model`, `micro_batch` prompts at a time and padded on the left as TRL pads them, so
    that an `AttentionScaleObserver` on it has scales before the first rollout.

    The forward enters through the model itself, not its decoder: under FSDP2 the first unit to run initialises the
    others, and a decoder entered alone makes each of its units a root (accelerate's tail unit, the final norm and
    lm_head together, then refuses to run). `logits_to_keep=1` keeps the vocabulary-sized logits to one position, so
    the peak stays that of a training forward.
    """
    from trl.trainer.utils import pad

    for start in range(0, len(prompt_ids), micro_batch):
        ids = [torch.tensor(p) for p in prompt_ids[start : start + micro_batch]]
        mask = pad([torch.ones_like(t) for t in ids], padding_value=0, padding_side="left")
        ids = pad(ids, padding_value=pad_token_id, padding_side="left")
        model(input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=1, use_cache=False)
