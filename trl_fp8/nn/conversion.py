"""`convert_to_fp8`: swap a model's eligible `nn.Linear` layers to FP8 in place and report what happened."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn

from trl_fp8.config import BLOCKWISE, FP8LinearConfig, LayerSelection
from trl_fp8.nn.adapters import hf_name, is_adapter_module, tuner_layer_names
from trl_fp8.nn.experts import FP8Experts, expert_layout_problem, is_experts_module
from trl_fp8.nn.fused_swiglu import fuse_swiglu
from trl_fp8.nn.linear import FP8Linear
from trl_fp8.nn.report import ConversionReport, report_fusions
from trl_fp8.nn.sibling_gemms import FUSED_GROUPS, group_fp8_siblings

logger = logging.getLogger(__name__)

__all__ = [
    "FUSED_GROUPS",
    "ConversionReport",
    "LayerSelection",
    "convert_to_fp8",
    "plan_fp8_conversion",
    "router_module_names",
    "is_fp8_linear",
    "fp8_recipe_of",
]

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# vLLM runs each of FUSED_GROUPS as one fused layer (qkv_proj, gate_up_proj): its members are all FP8 or all high
# precision.


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether `module` runs its GEMMs in FP8: a converted linear layer or expert layer."""
    return fp8_recipe_of(module) is not None


def fp8_recipe_of(module: nn.Module) -> str | None:
    """The FP8 recipe a converted linear or expert layer runs, or None for a high-precision module."""
    if isinstance(module, FP8Linear | FP8Experts):
        return module.fp8_config.recipe
    float8_linear = _torchao_float8_linear_cls()
    if float8_linear is not None and isinstance(module, float8_linear):
        return getattr(module, "_trl_fp8_recipe", "torchao")
    return None


def _torchao_float8_linear_cls():
    # No torchao Float8Linear can exist unless its module was imported; don't import torchao just to check.
    module = sys.modules.get("torchao.float8.float8_linear")
    return getattr(module, "Float8Linear", None)


def _num_layers(model: nn.Module, names: list[str]) -> int:
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if isinstance(n, int):
        return n
    indices = [int(m.group(1)) for name in names if (m := _LAYER_INDEX.search(name))]
    return max(indices) + 1 if indices else 0


def _output_embedding_weight(model: nn.Module):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head.weight if head is not None else None


def plan_fp8_conversion(
    model: nn.Module,
    recipe: str = BLOCKWISE,
    *,
    selection: LayerSelection | None = None,
    config: FP8LinearConfig | None = None,
    warn: bool = True,
    **layer_options,
) -> tuple[ConversionReport, list[tuple[str, nn.Module]]]:
    """Decide which linear and expert layers of `model` would be FP8, without changing it.

    `selection` says which layers to keep in high precision on purpose; its fields are also taken as keyword
    arguments (`num_first_layers_in_bf16=1`, ...), but not both. Returns the report (layers already FP8 count as
    converted) and the `(name, module)` pairs still to convert. Used by `convert_to_fp8` and by the exporter for
    models trained in BF16. Raises ValueError naming the layout for mixture-of-experts layers it cannot run in FP8,
    unless `keep_experts_in_bf16`.
    """
    config = _layer_config(recipe, config)
    selection = LayerSelection.of(selection, **layer_options)
    report = ConversionReport(recipe=config.recipe)
    tuners = tuner_layer_names(model)
    routers = router_module_names(model)
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    bf16_layers = _bf16_layers(model, [name for name, _ in linears], selection)
    head_weight = _output_embedding_weight(model)
    misfits = []

    to_convert: list[tuple[str, nn.Linear]] = []
    for name, mod in linears:
        existing = fp8_recipe_of(mod)
        if existing is not None:
            if existing != config.recipe:
                raise ValueError(
                    f"{name} is already FP8 with recipe {existing!r}; converting to {config.recipe!r} is not "
                    "supported. Start from the high-precision model."
                )
            report.converted.append(name)
            continue
        reason = "router" if name in routers else None
        reason = reason or _keep_reason(name, mod, config, head_weight, selection, bf16_layers, tuners)
        if reason is None:
            to_convert.append((name, mod))
            continue
        report.kept[name] = reason
        if reason.startswith("dims"):
            misfits.append(f"{name} {tuple(mod.weight.shape)}")
    to_convert = _keep_fused_groups_together(to_convert, report)
    if misfits and warn:
        warnings.warn(
            f"{len(misfits)} linear layer(s) kept in high precision because their dims are not multiples of "
            f"{config.dim_multiple}: {', '.join(misfits[:5])}{' ...' if len(misfits) > 5 else ''}",
            stacklevel=3,
        )
    report.converted.extend(name for name, _ in to_convert)
    to_convert += _plan_experts(model, config, report, selection, bf16_layers, warn)
    report.high_precision_params = _high_precision_params(model, report, tuners)
    return report, to_convert


def _layer_config(recipe: str, config: FP8LinearConfig | None) -> FP8LinearConfig:
    """`config`, or the default configuration of `recipe`; raises when both are given and disagree."""
    if config is None:
        return FP8LinearConfig(recipe=recipe)
    if config.recipe != recipe and recipe != BLOCKWISE:
        raise ValueError(f"recipe={recipe!r} disagrees with config.recipe={config.recipe!r}; pass one of them.")
    return config


def _bf16_layers(model: nn.Module, names: list[str], selection: LayerSelection) -> set[int]:
    """The decoder layer indices `selection` keeps in BF16; raises when that would be every layer."""
    first, last = selection.num_first_layers_in_bf16, selection.num_last_layers_in_bf16
    n_layers = _num_layers(model, names)
    if n_layers and first + last >= n_layers:
        raise ValueError(
            f"num_first_layers_in_bf16={first} + num_last_layers_in_bf16={last} keeps all {n_layers} decoder layers "
            "in BF16, so nothing would run in FP8. Lower them, or train in BF16 on purpose with fp8_recipe=None."
        )
    return set(range(min(first, n_layers))) | set(range(max(n_layers - last, 0), n_layers))


def _selection_reason(name: str, mod: nn.Module, selection: LayerSelection, bf16_layers: set[int]) -> str | None:
    """Why the layer choices of `selection` keep layer `name` in high precision, or None."""
    if (m := _LAYER_INDEX.search(name)) and int(m.group(1)) in bf16_layers:
        return "first/last layers in bf16"
    if selection.module_filter_fn is not None and not selection.module_filter_fn(mod, name):
        return "module_filter_fn"
    return None


def _plan_experts(model, config, report, selection, bf16_layers, warn):
    """The expert layers (3-D expert weights, transformers 5's fused layout) to convert; the others go to
    `report.kept` with their reason, or raise when their layout cannot run in FP8 and no opt-out was given."""
    to_convert = []

    def converted(name, mod):
        report.converted.append(name)
        report.experts.append(name)
        report.num_experts += mod.num_experts

    for name, mod in model.named_modules():
        if not is_experts_module(mod):
            continue
        if isinstance(mod, FP8Experts):
            converted(name, mod)
            continue
        problem = expert_layout_problem(mod, config.dim_multiple)
        if selection.keep_experts_in_bf16:
            reason = "keep_experts_in_bf16"
        elif (chosen := _selection_reason(name, mod, selection, bf16_layers)) is not None:
            reason = chosen
        elif problem is not None and problem.startswith("dims"):
            reason = problem
            if warn:
                warnings.warn(f"{name}: experts kept in high precision, {problem}.", stacklevel=4)
        elif problem is not None or config.recipe != BLOCKWISE:
            why = problem or f"FP8 experts need the blockwise recipe, not {config.recipe!r}"
            raise ValueError(
                f"{name}: {why}, so its experts (most of the model's weights) cannot run in FP8. Keep them in BF16 "
                "on purpose with keep_experts_in_bf16=True (the trainer config's fp8_keep_experts_in_bf16=True), or "
                "use the blockwise recipe on a model whose experts follow transformers' fused gate_up_proj / "
                "down_proj layout."
            )
        else:
            reason = None
        if reason is None:
            to_convert.append((name, mod))
            converted(name, mod)
        else:
            report.kept[name] = reason
    return to_convert


def _high_precision_params(model: nn.Module, report: ConversionReport, tuners) -> dict[str, str]:
    """Every parameter outside the FP8 layers' weights, with why it is not FP8."""
    fp8 = set(report.converted)
    routers = router_module_names(model)
    modules = dict(model.named_modules())
    reasons = {}
    for name, _ in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in fp8 and (leaf == "weight" or owner in report.experts):
            continue
        module = modules.get(owner)
        if owner in report.kept:
            reason = report.kept[owner]
        elif owner in routers:
            reason = "router"
        elif is_adapter_module(name, tuners):
            reason = "PEFT adapter"
        elif isinstance(module, nn.Embedding):
            reason = "embedding"
        elif isinstance(module, nn.modules.conv._ConvNd):
            reason = "convolution"
        elif "norm" in type(module).__name__.lower():
            reason = "norm"
        elif leaf == "bias":
            reason = "bias"
        else:
            reason = "not a linear or expert weight"
        reasons[name] = reason
    return reasons


def router_module_names(model: nn.Module) -> set[str]:
    """The routers of mixture-of-experts layers: the `gate` / `router` module beside each experts module. They stay
    in high precision (an FP8 router flips top-k choices) and are listed as such in exported checkpoints."""
    names = set()
    for name, mod in model.named_modules():
        if not is_experts_module(mod) or "." not in name:
            continue
        # (LoRA's `target_parameters` wraps the experts: `experts.base_layer.base_layer`; the router is beside `experts`)
        parent_name = re.sub(r"(\.base_layer)+$", "", name).rsplit(".", 1)[0]
        for child_name, child in model.get_submodule(parent_name).named_children():
            if child_name in ("gate", "router") or "router" in type(child).__name__.lower():
                names.add(f"{parent_name}.{child_name}")
    return names


def convert_to_fp8(
    model: nn.Module,
    recipe: str = BLOCKWISE,
    num_first_layers_in_bf16: int = 0,
    num_last_layers_in_bf16: int = 0,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    selection: LayerSelection | None = None,
    config: FP8LinearConfig | None = None,
    device: torch.device | str | None = None,
    keep_experts_in_bf16: bool = False,
) -> ConversionReport:
    """Convert the eligible `nn.Linear` layers and mixture-of-experts expert layers of `model` to FP8, in place.

    Expert layers (transformers 5's fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`) become `FP8Experts`:
    per-expert 128x128 weight blocks, the dense recipe's groups and GEMMs. Their routers stay in high precision. An
    expert layout that cannot run in FP8 raises, naming it, unless `keep_experts_in_bf16=True`. The report lists
    every parameter left in high precision with its reason (`high_precision_params`).

    Kept in high precision, with the reason in the report: the LM head (and any linear sharing the embedding
    weight), PEFT adapter layers, the first/last `num_*_layers_in_bf16` decoder layers (counted from the
    `layers.<i>.` index in module names), layers rejected by `module_filter_fn(module, fqn)`, layers whose dims
    are not multiples of 128 (16 for torchao's recipes), the last with a warning, and the siblings of any of these
    that vLLM fuses with them (q/k/v, gate/up: one fused layer is all FP8 or all high precision). Parameter names
    and `state_dict` keys do not change. Converting an already converted model is a no-op; converting it to another
    recipe raises. With `config.fuse_sibling_gemms`, q/k/v and gate/up then run as one FP8 GEMM per pass
    (`trl_fp8.nn.sibling_gemms`); with `config.fuse_swiglu`, gated MLPs fuse their activation into `down_proj`'s input
    quantization (`trl_fp8.nn.fused_swiglu`). The report lists what each fusion fused and every block it left unfused
    with the reason; a requested fusion that applies nowhere warns once. Convolutions and other weights that are
    neither linear nor experts stay as they are, listed in `high_precision_params`.

    Args:
        model: any `nn.Module`, typically a transformers causal LM (possibly PEFT-wrapped).
        recipe: "blockwise" (default), "tensorwise" or "rowwise".
        num_first_layers_in_bf16: decoder layers to keep in BF16 at the input end.
        num_last_layers_in_bf16: decoder layers to keep in BF16 at the output end.
        module_filter_fn: return False to keep a layer in high precision.
        selection: the layer choices above (and `keep_experts_in_bf16`) as one `LayerSelection`, instead of
            passing them one by one (not both).
        config: full layer configuration; its `recipe` must agree with `recipe` when both are given.
        device: the device the model will train on, when it is loaded elsewhere (torchao's recipes decide there
            whether to emulate). Default: where its parameters are. Blockwise layers pick their kernels per call.
        keep_experts_in_bf16: keep mixture-of-experts expert layers in BF16 (needed for layouts FP8 experts do not
            handle, which otherwise raise).

    Returns:
        A `ConversionReport`.

    Raises:
        ValueError: when no linear layer can run in FP8 (FP8 "training" that is really BF16 is a mistake to catch
            early; `fp8_recipe=None` is the way to ask for BF16).
    """
    config = _layer_config(recipe, config)
    selection = LayerSelection.of(
        selection, num_first_layers_in_bf16=num_first_layers_in_bf16, num_last_layers_in_bf16=num_last_layers_in_bf16,
        module_filter_fn=module_filter_fn, keep_experts_in_bf16=keep_experts_in_bf16,
    )  # fmt: skip
    report, to_convert = plan_fp8_conversion(model, selection=selection, config=config)
    if not report.converted:
        raise ValueError(
            f"No linear layer of {type(model).__name__} can run in FP8:\n{report.summary()}\nAdjust "
            "module_filter_fn (the trainer's fp8_module_filter_fn) / num_*_layers_in_bf16, or train in BF16 on "
            "purpose with fp8_recipe=None."
        )
    if config.recipe == BLOCKWISE:
        for _, mod in to_convert:
            (FP8Experts if is_experts_module(mod) else FP8Linear).convert_(mod, config)
        if config.fuse_sibling_gemms:
            group_fp8_siblings(model)
        if config.fuse_swiglu:
            fuse_swiglu(model)
        report_fusions(model, config, report)
    else:
        device = torch.device(device) if device is not None else next(model.parameters()).device
        _convert_with_torchao(model, config, {name for name, _ in to_convert}, device)
    logger.info(report.summary())
    return report


def _keep_reason(name, mod, config, head_weight, selection, bf16_layers, tuners) -> str | None:
    leaf = hf_name(name).rsplit(".", 1)[-1]
    if leaf == "lm_head" or (head_weight is not None and mod.weight is head_weight):
        return "lm_head"
    if is_adapter_module(name, tuners):
        return "LoRA adapter" if "lora_" in name else "PEFT adapter"
    if (chosen := _selection_reason(name, mod, selection, bf16_layers)) is not None:
        return chosen
    if type(mod).forward is not nn.Linear.forward:  # FP8Linear would run nn.Linear's math instead of its own
        return f"{type(mod).__name__} has its own forward, not nn.Linear's"
    n, k = mod.weight.shape
    if n % config.dim_multiple or k % config.dim_multiple:
        return f"dims not multiples of {config.dim_multiple}"
    if not mod.weight.is_floating_point():
        return f"weight dtype {mod.weight.dtype}"
    return None


def _keep_fused_groups_together(
    to_convert: list[tuple[str, nn.Linear]], report: ConversionReport
) -> list[tuple[str, nn.Linear]]:
    """Keep in high precision every layer whose fused-group siblings (vLLM's qkv_proj / gate_up_proj) stay there, so
    rollouts and the exported checkpoint can load; the report says which sibling and why."""
    planned = {hf_name(name): name for name, _ in to_convert}
    kept = {hf_name(name): reason for name, reason in report.kept.items()}
    held_back: dict[str, str] = {}
    for clean, name in planned.items():
        parent, _, leaf = clean.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), None)
        if group is None:
            continue
        blockers = [f"{m} ({kept[f'{parent}.{m}']})" for m in group if f"{parent}.{m}" in kept]
        if blockers:
            held_back[name] = f"vLLM fuses it with {', '.join(blockers)}"
    report.kept.update(held_back)
    return [(name, mod) for name, mod in to_convert if name not in held_back]


def _convert_with_torchao(model: nn.Module, config: FP8LinearConfig, names: set[str], device: torch.device) -> None:
    """torchao's tensorwise/rowwise `Float8Linear`, emulated off-GPU (torchao's own `emulate` flag)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if not names:
        return
    ao_config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(config.recipe),
        emulate=config.backend == "emulated" or device.type != "cuda",
    )
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in names, config=ao_config)
    for name, mod in model.named_modules():
        if name in names:
            mod._trl_fp8_recipe = config.recipe
            mod.fp8_config = config
