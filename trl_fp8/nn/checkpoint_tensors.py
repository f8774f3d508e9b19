"""What each layer puts in a block-FP8 checkpoint: the one source of the tensors the export writes and the vLLM
weight sync pushes (`checkpoint.save.fp8_checkpoint_tensors` walks the model and asks `checkpoint_tensors` for each of
its tensors; it decides the names, adapters and ties, this module what a layer's tensor becomes).

- A weight stored in FP8: `weight` (float8_e4m3fn) and `weight_scale_inv` (float32 per block). An `FP8Linear` gives
  its own quantized weight, bit for bit what its forward multiplies; any other layer (a weight with adapters merged,
  a high-precision layer planned for FP8) is quantized here by the recipe (an FP8 layer's own scale rounding).
- An experts layer's stacked `gate_up_proj [E, 2I, H]` or `down_proj [E, H, I]`: one tensor per expert and
  projection, each with its `weight_scale_inv` when FP8 (`expert_blocks` gives the stacked blocks, which the
  in-place vLLM expert write also reads).
- Anything else (embeddings, norms, biases, layers kept in high precision): as is, in `dtype`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from trl_fp8.distributed import compute_dtype, gather_whole, is_sharded
from trl_fp8.nn.experts import EXPERT_WEIGHTS, FP8Experts, is_experts_module
from trl_fp8.nn.linear import FP8Linear
from trl_fp8.recipe import DEFAULT_RECIPE, BlockwiseRecipe

__all__ = ["EXPERT_CHECKPOINT_PARTS", "all_finite", "checkpoint_tensors", "expert_blocks", "layer_recipe"]

# transformers 5 fuses each MoE layer's experts in memory; checkpoints (Hub releases, vLLM's loader) keep them apart.
EXPERT_CHECKPOINT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

_DIVERGED = "The training run diverged: lower the learning rate or resume from an earlier checkpoint."


def checkpoint_tensors(
    module: nn.Module,
    key: str,
    tensor: torch.Tensor,
    *,
    merged: torch.Tensor | None,
    fp8: bool,
    recipe: BlockwiseRecipe,
    names,
    check_finite: bool,
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(checkpoint name, tensor)` pairs for `tensor`, the state-dict entry `key` (a transformers name) of `module`.

    `merged`: the entry with PEFT adapters merged, exported instead of the layer's own; `fp8`: the layer is stored in
    FP8; `names`: the checkpoint's names (`checkpoint.names.CheckpointNames`); `dtype`: the high-precision tensors'
    (FP8 weights and their scales are never cast); `check_finite`: NaN/Inf raise (the sync skips the check).
    """
    leaf = key.rpartition(".")[2]
    if leaf in EXPERT_WEIGHTS and is_experts_module(module):
        weight = getattr(module, leaf) if merged is None else merged
        yield from _expert_tensors(module, key, weight, fp8, names, recipe, check_finite, dtype)
    elif fp8 and leaf == "weight":
        q, scale_inv = _fp8_linear_weight(module, key, merged, recipe, check_finite)
        yield names.tensor(key), q
        yield names.tensor(key) + "_scale_inv", scale_inv
    else:
        yield names.tensor(key), _high_precision(key, tensor, merged, check_finite, dtype)


def layer_recipe(module: nn.Module, default: BlockwiseRecipe) -> BlockwiseRecipe:
    """The recipe `module`'s weights are quantized with: an FP8 layer keeps its own scale rounding (for a weight
    with adapters merged too); any other layer takes `default`."""
    if isinstance(module, FP8Linear | FP8Experts):
        return BlockwiseRecipe(default.block, module.fp8_config.power_of_two_scales)
    return default


def _fp8_linear_weight(module, key, merged, recipe, check_finite) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight in FP8: an `FP8Linear`'s own blocks (FSDP2: gathered there), else quantized here."""
    if isinstance(module, FP8Linear) and merged is None:
        q, scale_inv = module.quantized_weight()
        weight = module.weight
    else:
        if merged is None and is_sharded(module.weight):
            raise NotImplementedError(
                f"{key}: exporting a sharded (FSDP2) layer that is not an FP8Linear is not supported; convert "
                "the model with convert_to_fp8 before sharding."
            )
        weight = module.weight.detach() if merged is None else merged
        q, scale_inv = layer_recipe(module, recipe).quantize(weight)
    if check_finite and not all_finite(weight):
        raise ValueError(f"{key} holds NaN or Inf values; refusing to write a corrupt FP8 checkpoint. {_DIVERGED}")
    return q, scale_inv


def _high_precision(key, tensor, merged, check_finite, dtype) -> torch.Tensor:
    """A tensor stored as it is (FSDP2: gathered whole, by every rank in the same order), cast to `dtype`."""
    if merged is not None:
        tensor = merged
    elif is_sharded(tensor):
        tensor = gather_whole(tensor, dtype)
    if check_finite and tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ValueError(f"{key} holds NaN or Inf values; refusing to write a corrupt checkpoint.")
    tensor = tensor.detach()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _expert_tensors(module, key, weight, fp8, names, recipe, check_finite, dtype):
    """`weight`, experts layer `module`'s `gate_up_proj [E, 2I, H]` or `down_proj [E, H, I]` (or it with adapters
    merged), as per-expert checkpoint tensors (gate and up `[I, H]`, or down), each with its `weight_scale_inv` when
    FP8 (`expert_blocks`)."""
    name, _, leaf = key.rpartition(".")
    if check_finite and not all_finite(weight):
        raise ValueError(f"{name}.{leaf} holds NaN or Inf values; refusing to write a corrupt checkpoint. {_DIVERGED}")
    parts = EXPERT_CHECKPOINT_PARTS[leaf]
    if is_sharded(weight) and not (fp8 and isinstance(module, FP8Experts) and weight is getattr(module, leaf)):
        # FSDP2 (sharded by expert): an FP8Experts layer gathers its own FP8 blocks; anything else comes whole, one
        # layer's stack at a time, in the dtype it is quantized from or written in.
        weight = gather_whole(weight, compute_dtype(weight) if fp8 else dtype)
    if fp8:
        q, scale = expert_blocks(module, leaf, weight, recipe)
    weight = weight.detach()
    for e in range(weight.shape[0]):
        for i in range(len(parts)):
            rows = slice(i * weight.shape[1] // len(parts), (i + 1) * weight.shape[1] // len(parts))
            disk = names.expert(key, e, i)
            if fp8:
                yield disk, q[e, rows]
                yield disk + "_scale_inv", scale[e, rows.start // recipe.block : rows.stop // recipe.block]
            else:
                yield disk, weight[e, rows].to(dtype) if dtype is not None else weight[e, rows]


def expert_blocks(
    module: nn.Module, leaf: str, weight: torch.Tensor, recipe: BlockwiseRecipe = DEFAULT_RECIPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [E, N, K], scale_inv [E, N/128, K/128])` of `weight`, experts layer `module`'s `leaf` or that weight with
    adapters merged. Its own parameter of an `FP8Experts` layer: the layer's own blocks, what its forward multiplies.
    Otherwise (a merged weight, or a BF16 run's experts planned for FP8) the recipe's blocks, expert by expert, with
    an `FP8Experts` layer's own scale rounding."""
    if isinstance(module, FP8Experts) and weight is getattr(module, leaf):
        # not a forward: the layer's cache serves it whatever the grad mode (cache_with_grad)
        with torch.no_grad():
            return module.quantized_expert_weight(leaf)
    return layer_recipe(module, recipe).quantize_experts(weight)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite; for an FSDP2 shard, every rank gets the same answer (so all raise or none)."""
    if not is_sharded(t):
        return bool(torch.isfinite(t).all())
    ok = torch.isfinite(t.to_local()).all().to(torch.float32).reshape(1)
    for group in t.device_mesh.get_all_groups():  # every mesh dimension (HSDP's mesh has two)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(ok.item())
