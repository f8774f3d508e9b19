"""The software stack trl-fp8 is tested on, and what to say when the installed one is outside it.

trl-fp8 overrides private hooks of TRL's trainers and reaches into vLLM's internals (`rollout/vllm/_compat.py`):
a release outside the tested ones may have moved one of them, so `trl-fp8 --version` and the trainer's start-up say
so plainly. `pyproject.toml`'s `vllm` extra resolves to the tested vLLM (and with it the torch vLLM pins);
`.ci/check_extras.py` checks what a fresh install of the extras resolves to against `TESTED`.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

logger = logging.getLogger(__name__)

__all__ = ["TESTED", "TESTED_ON", "installed_versions", "outside_tested_stack", "release", "warn_outside_tested_stack"]

# package -> the releases (major.minor) the CPU suite, the GPU suite or both passed on. vLLM 0.26 pins torch 2.11,
# vLLM 0.31 torch 2.13 (the GPU suite ran on each pair); torch 2.13 is also the CPU suite's. transformers is a range
# (pyproject.toml): the GPU suite's and the newest 5.x on the CPU suite.
TESTED = {"vllm": ("0.26", "0.31"), "torch": ("2.11", "2.13"), "trl": ("1.16",), "torchao": ("0.18",)}
TESTED_ON = "2026-12-04, the whole GPU suite on NVIDIA H200 with each vLLM"
_warned: list[str] = []


def release(package_version: str) -> str:
    """`major.minor` of a version string (`2.11.0+cu130` -> `2.11`)."""
    return ".".join(package_version.split("+")[0].split(".")[:2])


def installed_versions(packages) -> dict[str, str]:
    """name -> installed version, for the `packages` that are installed."""
    found = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def outside_tested_stack(installed: dict[str, str] | None = None) -> list[str]:
    """`vllm 0.29.0 (tested: 0.26, 0.31)` for each installed package of `TESTED` (or of `installed`, name -> version)
    whose release is not a tested one; empty when all are."""
    if installed is None:
        installed = installed_versions(TESTED)
    return [f"{name} {found} (tested: {', '.join(TESTED[name])})" for name, found in installed.items()
            if name in TESTED and release(found) not in TESTED[name]]  # fmt: skip


def warn_outside_tested_stack() -> None:
    """Once per process, a warning naming each installed package outside the tested releases."""
    if _warned or not (outside := outside_tested_stack()):
        return
    _warned.extend(outside)
    logger.warning(
        "Installed outside the releases trl-fp8 is tested on: %s. TRL's trainer hooks and vLLM's internals that "
        "trl-fp8 uses may have moved; install the tested releases (pip install -e '.[vllm]' resolves them) or run "
        "the test suites on yours (docs/tests.md; tests/test_trl_contract.py checks TRL's hooks).", "; ".join(outside),
    )  # fmt: skip
