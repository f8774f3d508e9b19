"""The trainer's FP8 experts written straight into a colocated vLLM engine's MoE layers.

The layerwise reload (`engine.push_to_engine`) takes experts as Qwen's FP8 checkpoints name them: one tensor per
expert and projection plus its scale, each run through vLLM's weight loader twice (once under a copy-counting
dispatch mode), after which the whole MoE layer is rebuilt and processed: thousands of small tensors a sync where
BF16 pushes a few stacked ones (the documentation's mixture-of-experts page has the times).

`EngineExperts` instead passes each FP8 experts layer's stacked weights and scales through vLLM's own
`convert_to_fp8_moe_kernel_format` (what `Fp8MoEMethod` applies after loading, for the engine's MoE backend) and
copies the result into the engine's tensors in place (the storage its CUDA graphs captured). It is used only once
proven: the first sync takes the reload path, then `EngineExperts.verified` checks that this path gives every engine
tensor bit for bit (dtype, shape and bits; a tensor-parallel shard or another layout fails the check) and otherwise
says why and leaves every later sync on the reload path. Not in sleep mode (see `EngineExperts.verified`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from trl_fp8.checkpoint.experts import fp8_experts_layers, merged_fp8_experts
from trl_fp8.distributed import is_sharded
from trl_fp8.nn.adapters import hf_name, is_tuner_layer, unwrap_model
from trl_fp8.nn.experts import EXPERT_WEIGHTS
from trl_fp8.rollout.vllm._compat import (
    LAYERWISE_RELOAD_LOGGER,
    engine_model,
    moe_kernel_format_converter,
    moe_kernel_scales,
)

__all__ = ["NO_FP8_EXPERTS", "EngineExperts", "engine_model", "quiet_skipped_layers"]

NO_FP8_EXPERTS = "no FP8 experts layer"


def _vllm_converter() -> Callable:
    return moe_kernel_format_converter()


class EngineExperts:
    """Pairs of (our experts layer, the engine's MoE layer) and the kernel-format tensors between them. Ours is the
    module at the transformers name: an `FP8Experts` layer, or the PEFT tuners wrapping one (LoRA's
    `target_parameters`), whose adapters are merged before quantization as in the reload's tensors."""

    def __init__(self, pairs: list[tuple[str, nn.Module, nn.Module]], convert: Callable):
        self.pairs, self.convert = pairs, convert
        self.names = {name for name, _, _ in pairs}  # transformers names of the experts written here

    @classmethod
    def verified(
        cls, model: nn.Module, llm, fp8_modules: set[str], *, sleep_mode: bool = False, convert: Callable | None = None
    ) -> tuple[EngineExperts | None, str]:
        """`(EngineExperts, what it writes)` if writing in place gives the colocated engine's current expert tensors
        bit for bit, else `(None, why not)`. Call it right after a reload pushed the same weights. Not with
        `sleep_mode`: TRL sleeps at level 2, which discards the engine's weights, and only the reload runs the MoE
        method's post-load processing again (whatever it derives besides the four tensors written here)."""
        hf_model = unwrap_model(model)
        fp8_modules = {hf_name(n) for n in fp8_modules}  # PEFT names or plain ones
        ours = [(n, m) for n, m in fp8_experts_layers(hf_model).items() if n in fp8_modules]
        if not ours:
            return None, NO_FP8_EXPERTS
        bases = [m.get_base_layer() if is_tuner_layer(m) else m for _, m in ours]
        if any(is_sharded(getattr(m, p)) for m in bases for p in EXPERT_WEIGHTS):
            return None, "the experts are sharded (FSDP2)"
        if sleep_mode:
            return None, "sleep mode discards the engine's MoE layers, which only the reload rebuilds"
        try:
            engine = engine_model(llm)
            theirs = {
                n: m for n, m in engine.named_modules() if hasattr(m, "w13_weight") and hasattr(m, "quant_method")
            }
            pairs = []
            for name, module in ours:
                found = [m for n, m in theirs.items() if n == name or n.startswith(name + ".")]
                if len(found) != 1:
                    return None, f"{len(found)} engine MoE layers under {name}"
                pairs.append((name, module, found[0]))
            writer = cls(pairs, convert or _vllm_converter())
            for name, module, layer in pairs:
                kernel_scales = moe_kernel_scales(layer)
                for key, ours_t in writer.kernel_tensors(module, layer).items():
                    for where, theirs_t in (("", getattr(layer, key)), (" (MoE kernel's)", kernel_scales.get(key))):
                        if theirs_t is None:
                            continue
                        if theirs_t.dtype != ours_t.dtype or theirs_t.shape != ours_t.shape:
                            return None, f"{name}.{key}{where}: the engine holds {theirs_t.dtype} " \
                                         f"{tuple(theirs_t.shape)}, the conversion gives {ours_t.dtype} " \
                                         f"{tuple(ours_t.shape)}"  # fmt: skip
                        if not torch.equal(_bits(theirs_t), _bits(ours_t)):
                            return None, f"{name}.{key}{where}: the conversion's values differ from the reload's"
        except Exception as exc:  # an engine layout this path does not know: the reload stays correct
            return None, f"{type(exc).__name__}: {exc}"
        return writer, f"{len(pairs)} MoE layers written in place"

    def kernel_tensors(self, module: nn.Module, layer: nn.Module) -> dict[str, torch.Tensor]:
        """The engine's tensor name -> its value from our FP8 experts (adapters merged), in the engine backend's
        kernel format."""
        fp8 = merged_fp8_experts(module)
        (w13, s13), (w2, s2) = (fp8[leaf] for leaf in EXPERT_WEIGHTS)
        scale = getattr(layer.quant_method, "weight_scale_name", "weight_scale_inv")  # block FP8: weight_scale_inv
        # Clones: a conversion may work in place, and these are the trainer's cached FP8 weights.
        w13, w2, s13, s2 = self.convert(
            fp8_backend=layer.quant_method.fp8_backend, layer=layer, w13=w13.clone(), w2=w2.clone(),
            w13_scale=s13.float().clone(), w2_scale=s2.float().clone(), w13_input_scale=None, w2_input_scale=None,
        )  # fmt: skip
        return {"w13_weight": w13, "w2_weight": w2, f"w13_{scale}": s13, f"w2_{scale}": s2}

    @torch.no_grad()
    def write(self) -> None:
        """Copy every pair's kernel-format tensors into the engine's own storage: the layer's (which its CUDA graphs
        read) and, where a reload left it other storage, the MoE kernel's scales (which a forward outside the graphs
        reads: `_compat.moe_kernel_scales`)."""
        for _, module, layer in self.pairs:
            kernel_scales = moe_kernel_scales(layer)
            for key, value in self.kernel_tensors(module, layer).items():
                target = getattr(layer, key)
                target.copy_(value)
                if (other := kernel_scales.get(key)) is not None and other.data_ptr() != target.data_ptr():
                    other.copy_(value)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


class _SkippedLayerFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


@contextlib.contextmanager
def quiet_skipped_layers():
    """vLLM's layerwise reload warns "Failed to load weights" for each layer that got no tensor and keeps its
    tensors as they are; the MoE layers written in place get none on purpose."""
    log = logging.getLogger(LAYERWISE_RELOAD_LOGGER)
    quiet = _SkippedLayerFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)
