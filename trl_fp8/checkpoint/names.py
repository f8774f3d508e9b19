"""The names `save_pretrained` gives a model's tensors on disk, and the per-expert parts of fused experts."""

from __future__ import annotations

import logging
import re
import weakref

import torch
from torch import nn

from trl_fp8.nn.adapters import hf_name, is_adapter_module, tuner_layer_names
from trl_fp8.nn.checkpoint_tensors import EXPERT_CHECKPOINT_PARTS
from trl_fp8.nn.experts import EXPERT_WEIGHTS, is_experts_module

__all__ = ["BASE_LAYER_SUFFIX", "EXPERT_CHECKPOINT_PARTS", "CheckpointNames", "checkpoint_names"]

logger = logging.getLogger(__name__)

# PEFT wraps a layer as `<name>.base_layer` (again for each tuner on it).
BASE_LAYER_SUFFIX = re.compile(r"(?:\.base_layer)+$")

_CHECKPOINT_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_names(hf_model: nn.Module) -> CheckpointNames:
    """`CheckpointNames` of `hf_model` (adapters left out), worked out once per model and state-dict layout."""
    tuners = tuner_layer_names(hf_model)
    keys = [hf_name(k) for k in hf_model.state_dict() if not is_adapter_module(k, tuners)]
    cached = _CHECKPOINT_NAMES.get(hf_model)
    if cached is None or cached[0] != keys:
        cached = (keys, CheckpointNames(hf_model, keys))
        _CHECKPOINT_NAMES[hf_model] = cached
    return cached[1]


class CheckpointNames:
    """The names transformers' `save_pretrained` gives each tensor on disk: its conversion mapping reverted (for MoE
    models: fused `experts.gate_up_proj [E, 2I, H]` split into one tensor per expert and projection, named as the
    family's Hub checkpoints name them, e.g. `mlp.experts.3.gate_proj.weight`, or Mixtral's `block_sparse_moe.
    experts.3.w1.weight`). Learnt once per model by reverting a stand-in state dict whose every element (each
    expert's each projection) carries a distinct code."""

    def __init__(self, hf_model: nn.Module, keys: list[str]):
        from transformers.core_model_loading import revert_weight_conversion

        modules = _modules_by_hf_name(hf_model)
        dummy, owner = {}, {}  # code -> (key, expert, part)
        for key in keys:
            prefix, _, leaf = key.rpartition(".")
            experts = leaf in EXPERT_WEIGHTS and is_experts_module(modules.get(prefix, nn.Module()))
            e, n = (getattr(modules[prefix], leaf).shape[0], len(EXPERT_CHECKPOINT_PARTS[leaf])) if experts else (1, 1)
            codes = torch.arange(len(owner), len(owner) + e * n, dtype=torch.float64)
            for code, (i, j) in zip(codes.tolist(), ((i, j) for i in range(e) for j in range(n)), strict=True):
                owner[code] = (key, i, j) if experts else (key, None, None)
            dummy[key] = codes.reshape(e, n, 1) if experts else codes
        self._names, self._experts = {}, {}
        try:
            reverted = revert_weight_conversion(hf_model, dummy)
        except Exception as exc:  # a model transformers cannot revert: its in-memory names, and say so
            logger.warning("transformers could not name %s's checkpoint tensors (%s); in-memory names are used.",
                           type(hf_model).__name__, exc)  # fmt: skip
            reverted = dummy
        for disk, tensor in reverted.items():
            if tensor.numel() != 1 or tensor.dtype != torch.float64 or tensor.item() not in owner:
                continue
            key, expert, part = owner[tensor.item()]
            if expert is None:
                self._names[key] = disk
            else:
                self._experts[(key, expert, part)] = disk

    def tensor(self, key: str) -> str:
        return self._names.get(key, key)

    def expert(self, key: str, expert: int, part: int) -> str:
        prefix, _, leaf = key.rpartition(".")
        default = f"{prefix}.{expert}.{EXPERT_CHECKPOINT_PARTS[leaf][part]}.weight"
        return self._experts.get((key, expert, part), default)


def _modules_by_hf_name(hf_model: nn.Module) -> dict[str, nn.Module]:
    """Transformers name -> the module there; under PEFT tuners, the base layer they wrap (the innermost)."""
    tuners = tuner_layer_names(hf_model)
    return {hf_name(n): m for n, m in hf_model.named_modules() if not is_adapter_module(n, tuners)}
