"""Each field trl-fp8 adds to TRL's configs is described once, in its class docstring, which is also its `--help`; the
public config stays short, the kernel selectors and benchmark knobs being `FP8Tuning`'s."""

from dataclasses import FrozenInstanceError, fields

import pytest
from trl import GRPOConfig, TrlParser

from trl_fp8 import FP8GRPOConfig, FP8RLOOConfig, FP8Tuning
from trl_fp8.field_docs import docstring_entries, field_help
from trl_fp8.trainer.config import FP8TrainingArguments


def own_fields(config_class, *bases) -> dict:
    """The fields `config_class` declares itself (not inherited from `bases`), by name."""
    inherited = {f.name for base in bases for f in fields(base)}
    return {f.name: f for f in fields(config_class) if f.name not in inherited}


@pytest.mark.parametrize(
    "config_class, bases",
    [(FP8TrainingArguments, ()), (FP8GRPOConfig, (FP8TrainingArguments, GRPOConfig)), (FP8Tuning, ())],
)
def test_each_field_is_described_once_in_the_docstring_and_that_is_its_help(config_class, bases):
    described = docstring_entries(config_class.__doc__)
    declared = own_fields(config_class, *bases)
    assert set(described) == set(declared), "a field without a docstring entry, or an entry of no field"
    for name, f in declared.items():
        assert f.metadata["help"] == described[name].replace("%", "%%")
        assert len(described[name]) > 20, f"{name}'s description says next to nothing"


def test_score_in_training_forward_says_how_its_metrics_are_logged():
    """Summed over the rollout batch's micro-batches and logged once (`_RolloutScoring`), not averaged per
    micro-batch: the help, `--help` and the API page say it from the docstring."""
    help_text = {f.name: f for f in fields(FP8GRPOConfig)}["score_in_training_forward"].metadata["help"]
    assert "averaged" not in help_text
    assert "summed over the rollout batch's micro-batches and logged once" in " ".join(help_text.split())


def test_an_entry_spans_its_continuation_lines_and_ends_at_the_next_entry():
    doc = """Intro.

    Args:
        alpha (int): The first
            line and its continuation,
            gamma (looks like an entry): but continues alpha,
            with 90% of it.
        beta (str | None): Another.

    Not part of beta.
    """
    assert docstring_entries(doc) == {
        "alpha": "The first line and its continuation, gamma (looks like an entry): but continues alpha, with 90% of "
        "it.",
        "beta": "Another.",
    }
    assert field_help(doc, "alpha", nargs="?")["help"].endswith("with 90%% of it.")
    assert field_help(doc, "beta", nargs="?")["nargs"] == "?"
    with pytest.raises(KeyError, match="no `Args:` entry for the field 'gamma'"):
        field_help(doc, "gamma")


@pytest.mark.parametrize("config_class", [FP8GRPOConfig, FP8RLOOConfig])
def test_the_command_line_help_lists_every_field_with_its_description(config_class):
    """TRL's parser (what `accelerate launch examples/grpo_fp8.py --help` prints) formats every help text."""
    text = " ".join(TrlParser((config_class,)).format_help().split())
    for name in own_fields(FP8TrainingArguments):
        assert f"--{name}" in text
    assert "of the GPU" in text  # fp8_cache_weights' description, with its "90%" formatted by argparse


# Kernel selectors and benchmark knobs, the same results either way: `FP8Tuning`'s, not the config's.
TUNING_FIELDS = {
    "fp8_fuse_sibling_gemms": "fuse_sibling_gemms",
    "fp8_fuse_swiglu": "fuse_swiglu",
    "fp8_experts_gemm": "experts_gemm",
    "compile_decoder_layers": "compile_decoder_layers",
    "fsdp2_prefetch_layers": "fsdp2_prefetch_layers",
    "ddp_gradient_as_bucket_view": "ddp_gradient_as_bucket_view",
    "vllm_act_quant_kernel": "vllm_act_quant_kernel",
    "vllm_fp8_kv_attention": "vllm_fp8_kv_attention",
    "vllm_norm_quant_kernel": "vllm_norm_quant_kernel",
    "vllm_deepgemm_workers": "vllm_deepgemm_workers",
}


def test_the_public_config_adds_at_most_twenty_one_fields_and_the_tuning_holds_the_rest():
    added = own_fields(FP8GRPOConfig, GRPOConfig)
    # 20 since the tuning took the kernel selectors; `exact_on_policy` (21st) changes what a run computes, so it is
    # the config's. A field that changes no result belongs in `FP8Tuning`.
    assert len(added) <= 21, sorted(added)
    assert not set(TUNING_FIELDS) & set(added) and not set(TUNING_FIELDS.values()) & set(added)
    assert {f.name for f in fields(FP8Tuning)} == set(TUNING_FIELDS.values())
    assert not set(TUNING_FIELDS) & {f.name for f in fields(FP8RLOOConfig)}


def test_the_tuning_keeps_the_defaults_the_measurements_chose_and_parses_beside_the_config():
    """The same defaults as the config fields it replaces; a script parses it beside the config
    (examples/grpo_fp8.py: `--fuse_swiglu`)."""
    assert "benchmarks and experiments" in FP8Tuning.__doc__ and "the measurements chose" in FP8Tuning.__doc__
    assert FP8Tuning() == FP8Tuning(fuse_sibling_gemms=False, fuse_swiglu=False, experts_gemm="auto",
                                    compile_decoder_layers=False, fsdp2_prefetch_layers=None,
                                    ddp_gradient_as_bucket_view=True, vllm_act_quant_kernel="auto",
                                    vllm_fp8_kv_attention="auto", vllm_norm_quant_kernel="auto",
                                    vllm_deepgemm_workers=None)  # fmt: skip
    with pytest.raises(FrozenInstanceError):
        FP8Tuning().fuse_swiglu = True
    config, tuning = TrlParser((FP8GRPOConfig, FP8Tuning)).parse_args_and_config(
        ["--output_dir", "unused", "--use_cpu", "--bf16", "false", "--fuse_swiglu", "--fsdp2_prefetch_layers", "2"]
    )
    assert tuning == FP8Tuning(fuse_swiglu=True, fsdp2_prefetch_layers=2) and not hasattr(config, "fuse_swiglu")
