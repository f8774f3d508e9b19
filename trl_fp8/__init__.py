"""trl-fp8: FP8 reinforcement learning of LLMs on Hugging Face TRL.

Public API: the blockwise quantizers, the FP8 linear and expert layers, the model conversion, the GRPO and RLOO
trainers, their configurations and tuning options, the exporter, and the rollout-capacity arithmetic behind `trl-fp8 plan`.
"""

from trl_fp8._quiet import drop_import_noise as _drop_import_noise

_drop_import_noise()  # before torchao is imported, wherever this package is imported first
# ruff: noqa: E402 (the filters above must come first)

from trl_fp8.config import FP8LinearConfig
from trl_fp8.nn.conversion import ConversionReport, convert_to_fp8, fp8_recipe_of, is_fp8_linear
from trl_fp8.nn.experts import FP8Experts
from trl_fp8.nn.linear import FP8Linear
from trl_fp8.quantization import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blocks,
    dequantize_groups,
    quantize_blocks,
    quantize_groups,
)
from trl_fp8.rollout.capacity import ModelShape, rollout_capacity

__version__ = "0.1.0"

_LAZY = {  # these import trl (heavy); load them on first use
    "FP8GRPOConfig": "trl_fp8.trainer.grpo_config",
    "FP8GRPOTrainer": "trl_fp8.trainer.grpo",
    "FP8RLOOConfig": "trl_fp8.trainer.config",
    "FP8RLOOTrainer": "trl_fp8.trainer.rloo",
    "FP8Tuning": "trl_fp8.tuning",
    "save_fp8_checkpoint": "trl_fp8.checkpoint.save",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "ConversionReport",
    "FP8GRPOConfig",
    "FP8GRPOTrainer",
    "FP8RLOOConfig",
    "FP8RLOOTrainer",
    "FP8Tuning",
    "FP8Experts",
    "FP8Linear",
    "FP8LinearConfig",
    "ModelShape",
    "convert_to_fp8",
    "dequantize_blocks",
    "dequantize_groups",
    "fp8_recipe_of",
    "is_fp8_linear",
    "quantize_blocks",
    "quantize_groups",
    "rollout_capacity",
    "save_fp8_checkpoint",
]
