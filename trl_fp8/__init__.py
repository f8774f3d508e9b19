"""trl-fp8: FP8 reinforcement learning of LLMs on Hugging Face TRL.

Public API: the blockwise quantizers, the FP8 linear and expert layers, the model conversion, the GRPO trainer and
its configuration, the exporter, and the rollout-capacity arithmetic behind `trl-fp8 plan`.
"""

from ._quiet import drop_import_noise as _drop_import_noise

_drop_import_noise()  # before torchao is imported, wherever this package is imported first

from .capacity import ModelShape, rollout_capacity
from .config import FP8LinearConfig
from .conversion import ConversionReport, convert_to_fp8, fp8_recipe_of, is_fp8_linear
from .fp8_experts import FP8Experts
from .fp8_linear import FP8Linear
from .quantization import FP8_DTYPE, FP8_MAX, dequantize_blocks, dequantize_groups, quantize_blocks, quantize_groups

__version__ = "0.1.0"

_LAZY = {  # these import trl (heavy); load them on first use
    "FP8GRPOConfig": ".grpo_config",
    "FP8GRPOTrainer": ".grpo_trainer",
    "save_fp8_checkpoint": ".export",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "ConversionReport",
    "FP8GRPOConfig",
    "FP8GRPOTrainer",
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
