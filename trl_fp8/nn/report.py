"""`ConversionReport`: what `convert_to_fp8` did, and for each requested fusion what it fused and what it left unfused
with why (`report_fusions`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from torch import nn

from trl_fp8.config import FP8LinearConfig
from trl_fp8.nn.adapters import hf_name
from trl_fp8.nn.experts import FP8Experts, is_experts_module
from trl_fp8.nn.fused_swiglu import GATED_MLP_LAYERS, is_fused_swiglu, swiglu_problem
from trl_fp8.nn.linear import FP8Linear
from trl_fp8.nn.sibling_gemms import FUSED_GROUPS, sibling_group_problem

__all__ = ["ConversionReport", "report_fusions"]


@dataclass
class ConversionReport:
    """What `convert_to_fp8` did: FP8 layers (linear layers and MoE expert layers), the layers kept in high
    precision with the reason, every other parameter left in high precision with its reason, and for each requested
    fusion what it fused and what it left unfused, with why."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)  # the converted names that are expert layers
    num_experts: int = 0  # experts in those layers
    high_precision_params: dict[str, str] = field(default_factory=dict)
    # Per requested fusion ("fuse_swiglu", "fuse_sibling_gemms"): what it fused, and what it left unfused and why.
    fused: dict[str, list[str]] = field(default_factory=dict)
    not_fused: dict[str, dict[str, str]] = field(default_factory=dict)
    # What the high-precision weights (FP8 layers' masters too) train in, when a trainer says it: "float32 (the
    # model's dtype)", "... with bfloat16 autocast (bf16=True)".
    precision: str | None = None

    @property
    def num_fp8_layers(self) -> int:
        return len(self.converted)

    def summary(self) -> str:
        if self.recipe == "bf16":  # fp8_recipe=None: trained in the model's own precision, not necessarily BF16
            return f"No FP8 (fp8_recipe=None): every layer trains in high precision, {self.precision or 'as loaded'}."
        linears = len(self.converted) - len(self.experts)
        what = f"{linears} linear layers"
        if self.experts:
            what += f" and {len(self.experts)} expert layers ({self.num_experts} experts)"
        lines = [f"FP8 ({self.recipe}): {what} converted, {len(self.kept)} kept."]
        if self.precision:
            lines.append(f"  master weights and high-precision layers: {self.precision}")
        lines += _grouped_lines("kept in high precision", self.kept)
        params = {n: r for n, r in self.high_precision_params.items() if r not in ("embedding", "norm", "bias")}
        lines += _grouped_lines("parameter in high precision", params)
        for fusion in sorted(set(self.fused) | set(self.not_fused)):
            done = self.fused.get(fusion, [])
            lines.append(f"  {fusion}: {len(done)} fused" + (f" ({_first_names(done)})" if done else ""))
            lines += _grouped_lines(f"{fusion} not applied", self.not_fused.get(fusion, {}))
        return "\n".join(lines)


def _grouped_lines(what: str, reasons_by_name: dict[str, str]) -> list[str]:
    reasons: dict[str, list[str]] = {}
    for name, reason in reasons_by_name.items():
        reasons.setdefault(reason, []).append(name)
    return [f"  {what} ({reason}): {_first_names(names)}" for reason, names in reasons.items()]


def _first_names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")


def report_fusions(model: nn.Module, config: FP8LinearConfig, report: ConversionReport) -> None:
    """Fill `report.fused` / `report.not_fused` for the requested fusions; warn once if one fused nothing."""
    outcomes = {"fuse_sibling_gemms": _sibling_outcome, "fuse_swiglu": _swiglu_outcome}
    for fusion, outcome in outcomes.items():
        if getattr(config, fusion):
            report.fused[fusion], report.not_fused[fusion] = outcome(model, report)
    idle = [fusion for fusion in report.not_fused if not report.fused[fusion]]
    if idle:
        reasons = "; ".join(f"{f}: {', '.join(sorted(set(report.not_fused[f].values()))[:3])}" for f in idle)
        options = " and ".join(idle)
        warnings.warn(
            f"{options} fused nothing in {type(model).__name__} ({reasons}). Its layers run unfused, with the same "
            f"FP8 math; drop {options} (with a trainer: FP8Tuning({'=False, '.join(idle)}=False)) to silence this.",
            stacklevel=3,
        )


def _layer_children(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_children() if any(True for _ in child.parameters())]


def _swiglu_outcome(model: nn.Module, report: ConversionReport) -> tuple[list[str], dict[str, str]]:
    """The MLPs running the fused SwiGLU forward, and every other MLP-like module with why it does not."""
    fused, skipped = [], {}
    for name, mod in model.named_modules():
        name = name or type(mod).__name__  # (the model itself)
        if is_fused_swiglu(mod):
            fused.append(name)
        elif is_experts_module(mod):
            skipped[name] = f"{_class_name(mod)} holds experts (fuse_swiglu fuses dense gated MLPs)"
        elif _looks_like_mlp(mod):
            skipped[name] = _unfusable_mlp_reason(mod)
    if not fused and not skipped:
        skipped[type(model).__name__] = "no MLP with gate_proj, up_proj, down_proj layers"
    return fused, skipped


def _class_name(module: nn.Module) -> str:
    """The model's own class name (an FP8 expert layer's class is `FP8<its class>`)."""
    return (type(module).__bases__[-1] if isinstance(module, FP8Experts) else type(module)).__name__


def _looks_like_mlp(module: nn.Module) -> bool:
    """A gated MLP by its layers (`down_proj`, or `gate_proj` with `up_proj`), or an MLP by its class name."""
    layers = {leaf for leaf in GATED_MLP_LAYERS if isinstance(getattr(module, leaf, None), nn.Module)}
    named_mlp = type(module).__name__.lower().endswith("mlp") and bool(_layer_children(module))
    return "down_proj" in layers or {"gate_proj", "up_proj"} <= layers or named_mlp


def _unfusable_mlp_reason(mlp: nn.Module) -> str:
    problem = swiglu_problem(mlp) or "not fused"
    if "not a gated MLP" in problem:  # say what it has instead
        problem += f" (it has {', '.join(_layer_children(mlp))})"
    return problem


def _sibling_outcome(model: nn.Module, report: ConversionReport) -> tuple[list[str], dict[str, str]]:
    """The sibling sets (q/k/v, gate/up) running as one FP8 GEMM, every other set with why not, and attention / MLP
    blocks that have no such set."""
    linears = {hf_name(n): m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = {hf_name(n): reason for n, reason in report.kept.items()}
    modules = {hf_name(n): m for n, m in model.named_modules()}
    sets = {}
    for name in linears:
        parent, _, leaf = name.rpartition(".")
        for group in FUSED_GROUPS:
            members = [linears.get(f"{parent}.{m}" if parent else m) for m in group]
            # (a lone gate_proj outside an MLP, a gate of something else, is no sibling set)
            if leaf in group and (sum(m is not None for m in members) > 1 or _is_block(modules.get(parent))):
                sets[(parent, group)] = members
    fused, skipped = [], {}
    for (parent, group), members in sets.items():
        label = f"{parent}.{'+'.join(group)}" if parent else "+".join(group)
        groups = [getattr(m, "_fp8_group", None) for m in members]  # (FP8SiblingGroup, index) once grouped
        if all(g is not None for g in groups) and len({id(g[0]) for g in groups}) == 1:
            fused.append(label)
        else:
            skipped[label] = _unfused_set_reason(parent, group, members, kept)
    grouped_parents = {parent for parent, _ in sets}
    for name, mod in model.named_modules():
        if hf_name(name) in grouped_parents or not _is_block(mod):
            continue
        group = FUSED_GROUPS[0] if type(mod).__name__.lower().endswith("attention") else FUSED_GROUPS[1]
        has = ", ".join(_layer_children(mod))
        skipped[name] = f"{type(mod).__name__} has no separate {', '.join(group)} (it has {has})"
    if not fused and not skipped:
        skipped[type(model).__name__] = "no q_proj/k_proj/v_proj or gate_proj/up_proj layers"
    return fused, skipped


def _is_block(module: nn.Module | None) -> bool:
    """An attention or MLP block, by its class name, that holds layers."""
    return (
        module is not None
        and type(module).__name__.lower().endswith(("attention", "mlp"))
        and bool(_layer_children(module))
    )


def _unfused_set_reason(parent: str, group: tuple[str, ...], members: list, kept: dict[str, str]) -> str:
    missing = [leaf for leaf, m in zip(group, members, strict=True) if m is None]
    if missing:
        return f"no {', '.join(missing)} beside {', '.join(leaf for leaf in group if leaf not in missing)}"
    prefix = f"{parent}." if parent else ""
    not_fp8 = [leaf for leaf, m in zip(group, members, strict=True) if not isinstance(m, FP8Linear)]
    if not_fp8:
        return "kept in high precision: " + ", ".join(f"{m} ({kept.get(prefix + m, 'not FP8')})" for m in not_fp8)
    return sibling_group_problem(members) or "not grouped"
