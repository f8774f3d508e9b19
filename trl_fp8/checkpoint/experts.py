"""Experts layers in a checkpoint: each expert's each projection as its own tensor, in FP8 with its block scales
where the layer is FP8 (`fp8_checkpoint_tensors` writes them; the colocated vLLM sync writes their stacked kernel
format in place, `trl_fp8.rollout.vllm.experts`)."""

from __future__ import annotations

import torch
from torch import nn

from trl_fp8.checkpoint.names import BASE_LAYER_SUFFIX, EXPERT_CHECKPOINT_PARTS
from trl_fp8.config import BLOCK
from trl_fp8.distributed import compute_dtype, gather_whole, is_sharded
from trl_fp8.nn.adapters import hf_name, is_adapter_module, is_tuner_layer, merged_base_parameters, tuner_layer_names
from trl_fp8.nn.experts import EXPERT_WEIGHTS, FP8Experts
from trl_fp8.quantization import FP8_DTYPE, quantize_blocks

__all__ = ["all_finite", "expert_tensors", "fp8_experts_layers", "merged_fp8_experts", "quantized_experts"]


def expert_tensors(module, key, leaf, weight, fp8, names, power_of_two_scales, check_finite, dtype):
    """`weight`, the `gate_up_proj [E, 2I, H]` or `down_proj [E, H, I]` of experts layer `module` (or it with adapters
    merged), as per-expert checkpoint tensors (gate and up `[I, H]`, or down), named as the family's checkpoints name
    them (`names`), each with its `weight_scale_inv` when FP8 (`quantized_experts`)."""
    name = key.rpartition(".")[0]
    if check_finite and not all_finite(weight):
        raise ValueError(
            f"{name}.{leaf} holds NaN or Inf values; refusing to write a corrupt checkpoint. The training run "
            "diverged: lower the learning rate or resume from an earlier checkpoint."
        )
    parts = EXPERT_CHECKPOINT_PARTS[leaf]
    if is_sharded(weight) and not (fp8 and isinstance(module, FP8Experts) and weight is getattr(module, leaf)):
        # FSDP2 (sharded by expert): an FP8Experts layer gathers its own FP8 blocks; anything else comes whole, one
        # layer's stack at a time, in the dtype it is quantized from or written in.
        weight = gather_whole(weight, compute_dtype(weight) if fp8 else dtype)
    if fp8:
        q, scale = quantized_experts(module, leaf, weight, power_of_two_scales)
    weight = weight.detach()
    for e in range(weight.shape[0]):
        for i in range(len(parts)):
            rows = slice(i * weight.shape[1] // len(parts), (i + 1) * weight.shape[1] // len(parts))
            disk = names.expert(key, e, i)
            if fp8:
                yield disk, q[e, rows]
                yield disk + "_scale_inv", scale[e, rows.start // BLOCK : rows.stop // BLOCK]
            else:
                yield disk, weight[e, rows].to(dtype) if dtype is not None else weight[e, rows]


def quantized_experts(
    module: nn.Module, leaf: str, weight: torch.Tensor, power_of_two_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [E, N, K], scale_inv [E, N/128, K/128])` of `weight`, experts layer `module`'s `leaf` or that weight with
    adapters merged. Its own parameter of an `FP8Experts` layer: the layer's own blocks, what its forward multiplies.
    Otherwise (a merged weight, or a BF16 run's experts planned for FP8) the same quantizer's blocks, expert by expert
    (no block spans two experts, so the bits are those of the whole stack; the temporaries are one expert's), with
    an `FP8Experts` layer's own scale rounding."""
    if isinstance(module, FP8Experts):
        if weight is getattr(module, leaf):
            # not a forward: the layer's cache serves it whatever the grad mode (cache_with_grad)
            with torch.no_grad():
                return module.quantized_expert_weight(leaf)
        power_of_two_scales = module.fp8_config.power_of_two_scales
    e, n, k = weight.shape
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty((e, n // BLOCK, k // BLOCK), dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        for i in range(e):
            q[i], scale[i] = quantize_blocks(weight[i].detach(), power_of_two_scales=power_of_two_scales)
    return q, scale


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
        return {leaf: quantized_experts(layer, leaf, getattr(layer, leaf)) for leaf in EXPERT_WEIGHTS}
    base, merged = layer.get_base_layer(), merged_base_parameters(layer)
    return {leaf: quantized_experts(base, leaf, merged[leaf]) for leaf in EXPERT_WEIGHTS}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite; for an FSDP2 shard, every rank gets the same answer (so all raise or none)."""
    if not is_sharded(t):
        return bool(torch.isfinite(t).all())
    ok = torch.isfinite(t.to_local()).all().to(torch.float32).reshape(1)
    for group in t.device_mesh.get_all_groups():  # every mesh dimension (HSDP's mesh has two)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(ok.item())
