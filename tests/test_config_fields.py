"""Each field trl-fp8 adds to TRL's configs is described once, in its class docstring, which is also its `--help`."""

from dataclasses import fields

import pytest
from trl import GRPOConfig, TrlParser

from trl_fp8 import FP8GRPOConfig, FP8RLOOConfig
from trl_fp8.trainer.config import FP8TrainingArguments
from trl_fp8.trainer.field_docs import docstring_entries, field_help


def own_fields(config_class, *bases) -> dict:
    """The fields `config_class` declares itself (not inherited from `bases`), by name."""
    inherited = {f.name for base in bases for f in fields(base)}
    return {f.name: f for f in fields(config_class) if f.name not in inherited}


@pytest.mark.parametrize(
    "config_class, bases",
    [(FP8TrainingArguments, ()), (FP8GRPOConfig, (FP8TrainingArguments, GRPOConfig))],
)
def test_each_field_is_described_once_in_the_docstring_and_that_is_its_help(config_class, bases):
    described = docstring_entries(config_class.__doc__)
    declared = own_fields(config_class, *bases)
    assert set(described) == set(declared), "a field without a docstring entry, or an entry of no field"
    for name, f in declared.items():
        assert f.metadata["help"] == described[name].replace("%", "%%")
        assert len(described[name]) > 20, f"{name}'s description says next to nothing"


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
