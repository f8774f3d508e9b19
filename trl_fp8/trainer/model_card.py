"""The FP8 section of the model card a trainer writes beside its checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trl_fp8.nn.conversion import ConversionReport

if TYPE_CHECKING:
    from trl_fp8.plan import FP8RunPlan

__all__ = ["fp8_model_card_section"]


def fp8_model_card_section(
    report: ConversionReport,
    args,
    export_report: ConversionReport | None = None,
    *,
    trainer_name: str,
    plan: FP8RunPlan | None = None,
) -> str:
    """The model card's FP8 section: the trainer (`trainer_name`) and its training recipe, the rollout correction
    that ran (token TIS, as the run's `plan` decided it), how the weights are stored, the layers kept in high precision
    (those of `export_report` for a BF16 run with an FP8 checkpoint)."""
    stored = export_report or report
    kept = sorted(stored.kept.items())
    if report.recipe == "bf16":
        trained = "without FP8 (`fp8_recipe=None`: every layer in high precision)"
    else:
        trained = f"with FP8 recipe `{report.recipe}` ({report.num_fp8_layers} linear layers in FP8"
        trained += (", power-of-two scales" if args.fp8_power_of_two_scales else "") + ")"
    token_tis = None if plan is None or plan.token_tis is None else plan.token_tis.value
    if token_tis is not None:
        trained += f", token TIS capped at {token_tis.cap}"
    lines = ["## FP8", "", f"Trained with trl-fp8's `{trainer_name}` {trained}.", ""]
    if args.save_fp8_checkpoint:
        lines += [
            f"The weights are a block-FP8 checkpoint ({stored.num_fp8_layers} linear layers in FP8; `quant_method: "
            "fp8`, 128x128 weight blocks, float32 `weight_scale_inv`, dynamic 1x128 activations): `vllm serve <this "
            "repo>` or `AutoModelForCausalLM.from_pretrained(<this repo>)` load it as is.",
            "",
        ]
    if kept:
        lines += ["Linear layers kept in high precision:", ""] + [f"- `{n}` ({why})" for n, why in kept] + [""]
    return "\n".join(lines)
