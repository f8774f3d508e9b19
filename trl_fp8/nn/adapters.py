"""PEFT adapters in what we export and sync: plain transformers names, which modules are adapters, and merged weights.

A merged weight is computed by PEFT's own `merge` (so LoRA, DoRA, LoHa, LoKr, IA3, VeRA, OFT, ... come out exactly as
`merge_and_unload()` makes them), run on a throwaway copy of the tuner layer whose base parameters are clones: the live
model, its adapters and its cached FP8 weights are never touched. Adapters that change the input rather than the
weights (prompt and prefix tuning, adaption prompts) cannot be merged and are refused with their type named.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from trl_fp8.distributed import is_sharded

__all__ = [
    "AdapterMergeError",
    "check_adapters_mergeable",
    "hf_name",
    "is_adapter_module",
    "is_tuner_layer",
    "merged_base_parameters",
    "tuner_layer_names",
    "unwrap_model",
]

# `q_proj.base_layer` -> `q_proj`; `lm_head.modules_to_save.default` -> `lm_head`.
_PEFT_MARKERS = re.compile(r"\.base_layer(?=\.|$)|\.modules_to_save\.[^.]+(?=\.|$)")


class AdapterMergeError(ValueError):
    """A PEFT adapter that cannot be folded into the weights vLLM and the checkpoint receive."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / accelerate / PEFT wrappers (adapter layers stay injected)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def hf_name(name: str) -> str:
    """PEFT module/parameter name -> the plain transformers name."""
    return _PEFT_MARKERS.sub("", name)


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether `module` is a PEFT tuner layer (a `base_layer` with adapters beside it)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(module, BaseTunerLayer)


def tuner_layer_names(model: nn.Module) -> list[str]:
    """Names (in `model`) of the PEFT tuner layers: modules wrapping a `base_layer` with adapters beside it."""
    return [name for name, module in model.named_modules() if is_tuner_layer(module)]


def is_adapter_module(name: str, tuner_names: list[str] | set[str]) -> bool:
    """Whether module or parameter `name` belongs to an adapter (inside a tuner layer, outside its base layer), or
    to the untouched original of a `modules_to_save` copy."""
    if ".original_module." in f".{name}.":
        return True
    for tuner in tuner_names:
        if name.startswith(tuner + ".") and not name.startswith(tuner + ".base_layer"):
            return True
    return False


def check_adapters_mergeable(model: nn.Module) -> None:
    """Raise `AdapterMergeError` naming the adapter type when `model` (possibly a `PeftModel` inside DDP/accelerate
    wrappers) carries an adapter that is not part of its weights and so cannot be merged into them."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    active = getattr(model, "active_adapters", None) or list(configs)
    for name in active if isinstance(active, list | tuple) else [active]:
        config = configs.get(name)
        if config is None:
            continue
        peft_type = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "?")))
        if getattr(config, "is_prompt_learning", False) or peft_type == "ADAPTION_PROMPT":
            raise AdapterMergeError(
                f"PEFT adapter {name!r} is of type {peft_type}, which adds learned prompt or prefix vectors "
                "instead of changing weights: it cannot be merged into the FP8 weights that vLLM and the checkpoint "
                "receive. Train a weight adapter (LoRA, DoRA, LoHa, LoKr, IA3, ...) or save the adapter alone with "
                "model.save_pretrained()."
            )


def merged_base_parameters(tuner: nn.Module) -> dict[str, torch.Tensor]:
    """The base layer's parameters (`weight`, and `bias` if any; an experts layer's 3-D `gate_up_proj` / `down_proj`)
    with the active adapters of `tuner` and of the tuners nested in it (LoRA's `target_parameters` wraps one per
    parameter) merged in by PEFT's own `merge`, exactly as `merge_and_unload()` computes them; nothing of `tuner`
    changes.

    Raises `AdapterMergeError` naming the tuner type when PEFT cannot merge it.
    """
    base = tuner.get_base_layer()
    if not tuner.merged_adapters and not tuner.active_adapters:
        return dict(base.named_parameters(recurse=False))
    work = _detached_copy(tuner)
    work_base = _detached_copy(base)
    for name, param in base.named_parameters(recurse=False):
        if is_sharded(param):
            raise NotImplementedError(
                f"Merging {type(tuner).__name__} adapters into an FSDP2-sharded layer is not supported: merge the "
                "adapters (model.merge_and_unload()) or train without FSDP2."
            )
        work_base._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=False)
    # Re-point the copy's (possibly nested) chain of base layers at the cloned one.
    chain = [work]
    while isinstance(chain[-1]._modules.get("base_layer"), nn.Module) and chain[-1]._modules["base_layer"] is not base:
        inner = _detached_copy(chain[-1]._modules["base_layer"])
        chain[-1]._modules["base_layer"] = inner
        chain.append(inner)
    chain[-1]._modules["base_layer"] = work_base
    try:
        with torch.no_grad():
            # Nested tuners (PEFT's `ParamWrapper`s, one per targeted parameter, e.g. an experts layer's gate_up_proj
            # and down_proj) each merge their own parameter: outer to inner, as `merge_and_unload()` does.
            for layer in chain:
                if is_tuner_layer(layer):
                    layer.merge(safe_merge=False)
    except Exception as exc:  # PEFT raises NotImplementedError, TypeError, ... for layers it cannot merge
        raise AdapterMergeError(
            f"PEFT cannot merge the {type(tuner).__name__} adapter of this layer into its weights ({exc}); trl-fp8 "
            "exports and syncs merged weights only. Use an adapter type PEFT can merge (LoRA, DoRA, LoHa, LoKr, "
            "IA3, ...)."
        ) from exc
    return dict(work_base.named_parameters(recurse=False))


def _detached_copy(module: nn.Module) -> nn.Module:
    """A shallow copy whose containers (parameters, submodules, caches, merged-adapter lists) are its own, so that
    merging into it leaves the original's state as it was; the tensors themselves are shared until replaced."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict | list | set):
            clone.__dict__[key] = copy.copy(value)
    return clone
