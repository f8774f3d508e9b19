"""Block-FP8 checkpoints in the format vLLM and transformers load (`quantization_config.quant_method == "fp8"`).

Each FP8 linear layer is stored as `<name>.weight` (float8_e4m3fn, `[N, K]`) and `<name>.weight_scale_inv` (float32,
`[N/128, K/128]`), taken from the layer's own quantized weight, i.e. the very values its training forward multiplies.
Everything else (embeddings, norms, lm_head, layers kept in high precision) is stored as is, in `dtype`.
`fp8_checkpoint_tensors` is the one place that produces these tensors, each layer's from its one per-layer source
(`nn.checkpoint_tensors`): the exporter writes them to disk and the vLLM weight sync streams them to a running engine.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

from trl_fp8.checkpoint.folder import replace_checkpoint
from trl_fp8.checkpoint.names import BASE_LAYER_SUFFIX, checkpoint_names
from trl_fp8.checkpoint.shards import write_shards
from trl_fp8.config import BLOCK
from trl_fp8.distributed import is_sharded, record_fsdp2_compute_dtypes
from trl_fp8.nn.adapters import (
    check_adapters_mergeable,
    hf_name,
    is_adapter_module,
    merged_base_parameters,
    tuner_layer_names,
    unwrap_model,
)
from trl_fp8.nn.checkpoint_tensors import checkpoint_tensors
from trl_fp8.nn.conversion import FUSED_GROUPS, is_fp8_linear, plan_fp8_conversion, router_module_names
from trl_fp8.nn.experts import EXPERT_WEIGHTS, is_experts_module
from trl_fp8.recipe import DEFAULT_RECIPE, BlockwiseRecipe

__all__ = [
    "QUANTIZATION_CONFIG",
    "checkpoint_config",
    "fp8_checkpoint_tensors",
    "hf_name",
    "linear_module_names",
    "fp8_module_names",
    "save_fp8_checkpoint",
    "unwrap_model",
]

logger = logging.getLogger(__name__)

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def fp8_module_names(model: nn.Module) -> set[str]:
    """Names (in `unwrap_model(model)`) of the linear layers the checkpoint stores in FP8.

    A converted model: its FP8 layers. A model trained in high precision: the layers `convert_to_fp8` would convert
    with its default options (the trainer passes its own plan instead, which honours its layer choices).
    """
    hf_model = unwrap_model(model)
    names = {name for name, mod in hf_model.named_modules() if is_fp8_linear(mod)}
    if not names:
        report, _ = plan_fp8_conversion(hf_model, warn=False)
        names = set(report.converted)
    return names


def fp8_checkpoint_tensors(
    model: nn.Module,
    *,
    fp8_modules: set[str] | None = None,
    recipe: BlockwiseRecipe = DEFAULT_RECIPE,
    check_finite: bool = True,
    dtype: torch.dtype | None = None,
    skip_experts: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` pairs of the block-FP8 checkpoint of `model`, in transformers names, on its device.

    Walks the state dict and asks each tensor's layer what it contributes (`nn.checkpoint_tensors`: FP8 weights with
    their `weight_scale_inv`, experts per expert, the rest as is); decided here: which layers are FP8, the names,
    the tied lm_head (left out: vLLM and transformers re-tie it), and PEFT adapters, whose tensors are never yielded
    but merged into their layer's by PEFT's own `merge` (`adapters.merged_base_parameters`: LoRA, DoRA, LoHa, IA3,
    ...; LoRA on experts through `target_parameters`); adapters that cannot be merged (prompt tuning, ...) raise
    naming their type. `fp8_modules=set()` gives the plain high-precision checkpoint (adapters still merged).
    `recipe`: the block shape and scale rounding of layers quantized here (FP8 layers keep their own rounding).
    `dtype` casts the high-precision tensors. `skip_experts`: experts layers (transformers names) whose weights are
    left out (a sync that writes them another way, `vllm_experts`).
    """
    check_adapters_mergeable(model)
    hf_model = unwrap_model(model)
    record_fsdp2_compute_dtypes(hf_model)  # FSDP2: each FP8 weight is quantized from the dtype its forward sees
    modules = dict(hf_model.named_modules())
    merged = _MergedTuners(modules, tuner_layer_names(hf_model))
    fp8_modules = fp8_module_names(model) if fp8_modules is None else fp8_modules
    # Compare in transformers names: the set may have been taken before PEFT wrapped the layers (`q_proj`) while the
    # state dict is read after (`q_proj.base_layer`), or the other way round.
    fp8_modules = {hf_name(n) for n in fp8_modules}
    tie = bool(getattr(getattr(hf_model, "config", None), "tie_word_embeddings", False))
    names = checkpoint_names(hf_model)
    seen_storage: set[int] = set()
    for key, tensor in hf_model.state_dict().items():
        if is_adapter_module(key, merged.tuners):
            continue
        prefix, _, leaf = key.rpartition(".")
        storage = (tensor.to_local() if is_sharded(tensor) else tensor).data_ptr()
        if tie and storage in seen_storage:
            continue  # the tied lm_head: vLLM and transformers re-tie it from the embedding
        seen_storage.add(storage)
        module, layer = modules[prefix], hf_name(prefix)
        if layer in skip_experts and leaf in EXPERT_WEIGHTS and is_experts_module(module):
            continue
        yield from checkpoint_tensors(module, hf_name(key), tensor, merged=merged.get(prefix, leaf),
                                      fp8=layer in fp8_modules, recipe=recipe, names=names, check_finite=check_finite,
                                      dtype=dtype)  # fmt: skip


class _MergedTuners:
    """The parameters of PEFT tuner layers with their adapters merged, one tuner layer at a time (the state dict
    lists a layer's tensors together)."""

    def __init__(self, modules: dict[str, nn.Module], tuners: list[str]):
        self.modules, self.tuners = modules, set(tuners)
        self._current: tuple[str, dict[str, torch.Tensor]] | None = None

    def get(self, prefix: str, leaf: str) -> torch.Tensor | None:
        """The merged `leaf` of the base layer at `prefix` (`<tuner>.base_layer`), or None outside a tuner."""
        if not BASE_LAYER_SUFFIX.search(prefix):
            return None
        tuner = BASE_LAYER_SUFFIX.sub("", prefix)
        if tuner not in self.tuners:
            return None
        if self._current is None or self._current[0] != tuner:
            self._current = (tuner, merged_base_parameters(self.modules[tuner]))
        return self._current[1].get(leaf)


def check_fused_groups(fp8_modules: set[str], linear_names: set[str]) -> None:
    """vLLM fuses q/k/v and gate/up: a layer with only some of them in FP8 cannot load. Raise naming the fix."""
    for name in linear_names:
        for group in FUSED_GROUPS:
            leaf = name.rsplit(".", 1)[-1]
            if leaf != group[0]:
                continue
            siblings = [name[: -len(leaf)] + member for member in group]
            states = {s: s in fp8_modules for s in siblings if s in linear_names}
            if len(set(states.values())) > 1:
                raise ValueError(
                    f"vLLM fuses {', '.join(group)} into one layer, but only some are FP8 here: {states}. Store all "
                    "of them in FP8 or none (convert_to_fp8 and plan_fp8_conversion choose so on their own)."
                )


def linear_module_names(model: nn.Module) -> set[str]:
    """Transformers names of the layers a block-FP8 checkpoint stores either in FP8 or in `modules_to_not_convert`:
    linear layers, mixture-of-experts expert layers and their routers (adapter layers excluded)."""
    hf_model = unwrap_model(model)
    tuners = tuner_layer_names(hf_model)
    layers = {
        hf_name(n)
        for n, m in hf_model.named_modules()
        if (isinstance(m, nn.Linear) or is_experts_module(m)) and not is_adapter_module(n, tuners)
    }
    return layers | {hf_name(n) for n in router_module_names(hf_model)}


def checkpoint_config(
    hf_model: nn.Module, fp8_modules: set[str], linear_names: set[str], dtype: torch.dtype | None
) -> dict:
    """`config.json` of the checkpoint: the model's config plus `quantization_config` when any layer is FP8."""
    config = hf_model.config.to_dict()
    # save_pretrained fills this in; loaders (vLLM above all) pick the model class from it.
    config["architectures"] = config.get("architectures") or [type(hf_model).__name__]
    config.pop("quantization_config", None)
    if fp8_modules:
        kept = linear_names - fp8_modules
        config["quantization_config"] = {
            **QUANTIZATION_CONFIG,
            # transformers matches its in-memory module names, vLLM the checkpoint's (Mixtral: block_sparse_moe.*)
            "modules_to_not_convert": sorted(kept | _disk_module_names(hf_model, kept)),
        }
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
    return config


def _disk_module_names(hf_model: nn.Module, modules: set[str]) -> set[str]:
    """The checkpoint's names of `modules` where they differ from the in-memory ones."""
    names, found = checkpoint_names(hf_model), set()
    tuners = tuner_layer_names(hf_model)
    params = {hf_name(n) for n, _ in hf_model.named_parameters() if not is_adapter_module(n, tuners)}
    for module in modules:
        for leaf in ("weight", *EXPERT_WEIGHTS):
            if f"{module}.{leaf}" in params:
                key = f"{module}.{leaf}"
                disk = names.expert(key, 0, 0).rsplit(".", 3)[0] if leaf in EXPERT_WEIGHTS else names.tensor(key)
                found.add(disk.removesuffix(".weight"))
                break
    return found - modules


def save_fp8_checkpoint(
    model: nn.Module,
    output_dir: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase | ProcessorMixin | None = None,
    *,
    fp8_modules: set[str] | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    power_of_two_scales: bool = False,
    max_shard_size: int = 5 * 2**30,
    extra_files: dict[str, str] | None = None,
    write_extra: Callable[[Path], None] | None = None,
    before_swap: Callable[[], None] | None = None,
    progress: bool = True,
    write: bool = True,
) -> Path:
    """Write `model` as a block-FP8 checkpoint to `output_dir` (vLLM: `LLM(output_dir)`; transformers:
    `AutoModelForCausalLM.from_pretrained(output_dir)`).

    Args:
        model: a transformers causal LM, converted with `convert_to_fp8` or not (then its eligible layers are
            quantized here), possibly PEFT-wrapped (adapters are merged into the exported weights by PEFT's own
            merge; adapters that cannot be merged raise, naming their type).
        output_dir: created if needed. The checkpoint of an earlier save there is replaced as a whole (its weights,
            shards, adapters, configs, tokenizer); other entries (training `checkpoint-*` folders, logs) are kept.
        tokenizer: saved alongside when given.
        fp8_modules: names of the layers to store in FP8 (default: :func:`fp8_module_names`).
        dtype: dtype of the high-precision tensors (None keeps the model's).
        max_shard_size: bytes per safetensors shard.
        extra_files: `{filename: text}` written with the checkpoint (e.g. a model card).
        write_extra: `fn(folder)` writing more files into the new checkpoint before it is swapped in.
        before_swap: called right before the new checkpoint replaces the old one (the trainer waits there for a Hub
            upload of `output_dir` that is in flight).
        write: False on the ranks of a sharded (FSDP2) model that do not write: they still walk the tensors, taking
            part in gathering each one, which every rank must do in the same order.

    Tensors stream to disk one safetensors shard at a time, so the writer holds at most one shard in memory (FSDP2:
    one gathered tensor at a time on each rank besides). The save is atomic (`checkpoint.folder.replace_checkpoint`):
    the checkpoint is written to a folder beside `output_dir` and swapped in whole, so `output_dir` holds the old
    checkpoint or the new one whatever happens, and NaN/Inf weights raise before it is touched. A custom-code model
    (`trust_remote_code`) gets its code files, as `save_pretrained` writes them.
    """
    check_adapters_mergeable(model)
    hf_model = unwrap_model(model)
    fp8_modules = fp8_module_names(model) if fp8_modules is None else fp8_modules
    linear_names = linear_module_names(hf_model)
    clean_fp8 = {hf_name(n) for n in fp8_modules}
    check_fused_groups(clean_fp8, linear_names)

    recipe = BlockwiseRecipe(power_of_two_scales=power_of_two_scales)
    pairs = fp8_checkpoint_tensors(model, fp8_modules=fp8_modules, recipe=recipe)
    out = Path(output_dir)
    if not write:
        for _ in pairs:  # take part in the gathers
            pass
        return out

    with replace_checkpoint(out, before_swap=before_swap) as tmp:
        _save_custom_code(hf_model, tmp)  # before the config: it adds the `auto_map` entries
        config = checkpoint_config(hf_model, clean_fp8, linear_names, dtype)
        write_shards(pairs, tmp, max_shard_size=max_shard_size, dtype=dtype, progress=progress)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        generation_config = getattr(hf_model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        if write_extra is not None:
            write_extra(tmp)
    return out


def _save_custom_code(hf_model: nn.Module, folder: Path) -> None:
    """Copy a custom-code model's (and config's) Python files and set their `auto_map`, as `save_pretrained` does,
    so `from_pretrained(..., trust_remote_code=True)` can load the checkpoint anywhere."""
    from transformers.dynamic_module_utils import custom_object_save

    config = getattr(hf_model, "config", None)
    if getattr(type(hf_model), "_auto_class", None) is not None:
        custom_object_save(hf_model, folder, config=config)
    if config is not None and getattr(type(config), "_auto_class", None) is not None:
        custom_object_save(config, folder, config=config)
