"""Triton configurations of vLLM's block-FP8 fused MoE that trl-fp8 tuned for the decode token counts GRPO rollouts
make, handed to vLLM through its own `VLLM_TUNED_CONFIG_FOLDER`.

vLLM ships one tuned configuration file per expert shape, GPU and dtype (`fused_moe/configs/E=..,N=..,device_name=..,
dtype=fp8_w8a8,block_shape=[128,128].json`: a Triton tile per token count) and reads a file of the same name from
`VLLM_TUNED_CONFIG_FOLDER` first. `tuned_moe_configs/` holds such files, written by `benchmarks/bench_moe_decode.py
--tune --tune_out`: vLLM's own entries, with the ones the sweep found faster (by a margin, output checked) at the
decode token counts in their place. A shape or GPU without a file here keeps vLLM's; so does a user's own
`VLLM_TUNED_CONFIG_FOLDER`. Only the kernel's tiling changes: the weights, scales and values are the same.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TUNED_MOE_CONFIGS", "tuned_moe_config_env", "tuned_moe_config_files"]

TUNED_MOE_CONFIGS = Path(__file__).with_name("tuned_moe_configs")


def tuned_moe_config_files() -> list[str]:
    """The configuration files trl-fp8 ships (names as vLLM builds them)."""
    return sorted(path.name for path in TUNED_MOE_CONFIGS.glob("*.json"))


def tuned_moe_config_env(environ=os.environ) -> dict[str, str]:
    """`{"VLLM_TUNED_CONFIG_FOLDER": <trl-fp8's folder>}` for a vLLM process to read, or `{}` where trl-fp8 ships no
    file or the user named their own folder (vLLM then reads theirs, then its own)."""
    if environ.get("VLLM_TUNED_CONFIG_FOLDER") or not tuned_moe_config_files():
        return {}
    return {"VLLM_TUNED_CONFIG_FOLDER": str(TUNED_MOE_CONFIGS)}
