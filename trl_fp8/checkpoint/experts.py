"""The FP8 experts layers of a model by transformers name, and their stacked FP8 blocks with adapters merged: what
the colocated vLLM sync writes in place (`trl_fp8.rollout.vllm.experts`), from the same per-layer source as the
export's per-expert tensors (`nn.checkpoint_tensors.expert_blocks`)."""

from __future__ import annotations

import torch
from torch import nn

from trl_fp8.checkpoint.names import BASE_LAYER_SUFFIX
from trl_fp8.nn.adapters import hf_name, is_adapter_module, is_tuner_layer, merged_base_parameters, tuner_layer_names
from trl_fp8.nn.checkpoint_tensors import expert_blocks
from trl_fp8.nn.experts import EXPERT_WEIGHTS, FP8Experts

__all__ = ["fp8_experts_layers", "merged_fp8_experts"]


def fp8_experts_layers(hf_model: nn.Module) -> dict[str, nn.Module]:
    """Transformers name -> the module `merged_fp8_experts` takes for each `FP8Experts` layer: the layer, or the PEFT
    tuners wrapping it (LoRA's `target_parameters`: `experts.base_layer.base_layer`)."""
    modules, tuners = dict(hf_model.named_modules()), tuner_layer_names(hf_model)
    return {
        hf_name(name): modules[BASE_LAYER_SUFFIX.sub("", name)]
        for name, module in modules.items()
        if isinstance(module, FP8Experts) and not is_adapter_module(name, tuners)
    }


def merged_fp8_experts(layer: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{"gate_up_proj": (q, scale_inv), "down_proj": ...}` of the FP8 experts layer at a transformers name: an
    `FP8Experts` layer, or the PEFT tuners wrapping one (LoRA's `target_parameters`), whose adapters are then merged
    by PEFT's own merge before quantization, as `fp8_checkpoint_tensors` does."""
    if not is_tuner_layer(layer):
        return {leaf: expert_blocks(layer, leaf, getattr(layer, leaf)) for leaf in EXPERT_WEIGHTS}
    base, merged = layer.get_base_layer(), merged_base_parameters(layer)
    return {leaf: expert_blocks(base, leaf, merged[leaf]) for leaf in EXPERT_WEIGHTS}
