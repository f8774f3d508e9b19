"""The tested releases (`trl_fp8.stack`): `trl-fp8 --version` and the trainer's start-up name an installed vLLM,
torch, TRL or torchao outside them."""

import logging

import pytest

from trl_fp8 import stack
from trl_fp8.cli.main import main as cli


def test_releases_outside_the_tested_ones_are_named():
    assert stack.release("2.11.0+cu130") == "2.11" and stack.release("0.26.0") == "0.26"
    assert stack.outside_tested_stack({"vllm": "0.26.0", "torch": "2.11.0+cu130", "trl": "1.16.0"}) == []
    assert stack.outside_tested_stack({"vllm": "0.31.0", "torch": "2.13.0", "trl": "1.16.0"}) == []
    assert stack.outside_tested_stack({"vllm": "0.29.0", "torch": "2.13.0", "numpy": "9.0"}) == [
        "vllm 0.29.0 (tested: 0.26, 0.31)"
    ]


@pytest.fixture
def vllm_029(monkeypatch):
    """An installed vLLM between the tested releases (the `vllm` extra leaves 0.27-0.30 out)."""
    real = stack.version
    monkeypatch.setattr(stack, "version", lambda name: "0.29.0" if name == "vllm" else real(name))
    monkeypatch.setattr(stack, "_warned", [])


def test_version_flags_an_untested_vllm(capsys, vllm_029):
    with pytest.raises(SystemExit) as exit_info:
        cli(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("Tested on: vllm 0.26 / 0.31, torch 2.11 / 2.13, trl 1.16, torchao 0.18")
    assert lines[2].startswith("Outside the tested releases: vllm 0.29.0 (tested: 0.26, 0.31)")


def test_version_says_nothing_more_on_the_tested_stack(capsys, monkeypatch):
    tested = {"vllm": "0.31.0", "torch": "2.13.0", "trl": "1.16.0", "torchao": "0.18.0"}
    real = stack.version
    monkeypatch.setattr(stack, "version", lambda name: tested[name] if name in tested else real(name))
    with pytest.raises(SystemExit):
        cli(["--version"])
    assert "Outside the tested releases" not in capsys.readouterr().out


def test_start_up_warns_once_about_an_untested_vllm(caplog, vllm_029):
    with caplog.at_level(logging.WARNING, logger="trl_fp8.stack"):
        stack.warn_outside_tested_stack()
        stack.warn_outside_tested_stack()
    warnings = [r.getMessage() for r in caplog.records if r.name == "trl_fp8.stack"]
    assert len(warnings) == 1 and "vllm 0.29.0 (tested: 0.26, 0.31)" in warnings[0]
