"""Regional compilation of the policy: every repeated decoder layer compiled in place by `torch.compile`.

An eager FP8 linear layer issues more host work per call than its GEMMs take on a small model (quantizer launches,
autograd glue), so the training phase can be host-bound where BF16 is not. Compiled, a decoder layer's FP8 ops enter
one graph whole (`trl_fp8.ops.library`: quantizers Inductor launches itself, the GEMM one op) and the BF16 ops around
them (norms, RoPE, SwiGLU) fuse (the documentation's benchmarks have the training-phase times).

In place (`nn.Module.compile`), so parameter names, the state dict, PEFT, the weight sync and the export see the
same model; the decoder layers share one graph (Dynamo lifts module parameters to graph inputs), so a 36-layer model
compiles about as fast as one layer. This is accelerate's in-place regional compilation
(`accelerate.utils.compile_regions_deepspeed`) restricted to the repeated blocks: the embedding and `lm_head` stay
eager.

Under activation checkpointing a compiled layer is traced inside the checkpoint's higher-order op, which refuses any
write to state from outside the layer (the recompute in the backward would replay it): transformers from 5.25 routes
each attention forward through the `kernels` package's hub-kernel wrapper, which sets a context variable and resets it
on the way out. Dynamo would drop the whole layer to eager for that, silently. The write leaves nothing behind once the
forward returns, so `compile_decoder_layers` tells Dynamo not to replay forward side effects in the recompute
(`skip_fwd_side_effects_in_bwd_under_checkpoint`, a process-wide setting; torchtitan sets it for its compiled blocks
too).

Generation runs the layers eagerly (`eager_generation`): `model.generate` calls them with a new query and KV-cache
length at every token, which would recompile them until Dynamo's `recompile_limit`, after which every call, the
training forwards included, runs eagerly.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from trl_fp8.config import FP8LinearConfig
from trl_fp8.nn.adapters import unwrap_model

__all__ = ["compile_decoder_layers", "eager_generation"]


def compile_decoder_layers(model: nn.Module, **compile_kwargs) -> int:
    """Compile in place each block of every `nn.ModuleList` of identical blocks (accelerate's
    `is_repeated_blocks`: a model's decoder layers), outermost lists only. Returns how many blocks were compiled;
    raises naming the fix for a model without such a list, or with FP8 fusions, which compiled layers would skip."""
    from accelerate.utils.other import is_repeated_blocks

    root = unwrap_model(model)
    if fusions := eager_only_fusions(root):
        raise ValueError(
            f"The model's FP8 layers were converted with {' and '.join(fusions)}, which run in eager mode only: in a "
            "compiled decoder layer they would run unfused. Convert without them, or leave the layers uncompiled."
        )
    compiled = 0
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # see the module's docstring
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True

    def visit(module: nn.Module) -> None:
        nonlocal compiled
        if isinstance(module, nn.ModuleList) and len(module) > 1 and is_repeated_blocks(module):
            for block in module:
                block.compile(**compile_kwargs)
                compiled += 1
            return  # a block's own lists (experts of older MoE layouts) are inside its graph already
        for child in module.children():
            visit(child)

    visit(root)
    if compiled == 0:
        raise ValueError(
            f"compile_decoder_layers found no list of repeated decoder layers in {type(root).__name__}. Drop "
            "FP8Tuning(compile_decoder_layers=True) (or compile the model yourself with torch.compile)."
        )
    return compiled


def eager_only_fusions(model: nn.Module) -> list[str]:
    """The fusions (`FP8LinearConfig` fields) that some FP8 layer of `model` was converted with: they step aside
    inside a compiled region (`sibling_gemms`, `fused_swiglu`), so compiling the layers would switch them off."""
    configs = {m.fp8_config for m in model.modules() if isinstance(getattr(m, "fp8_config", None), FP8LinearConfig)}
    return [name for name in ("fuse_sibling_gemms", "fuse_swiglu") if any(getattr(c, name) for c in configs)]


@contextlib.contextmanager
def eager_generation(compiled_layers: int):
    """Within the block, compiled layers run their eager forward (and never compile) when `compiled_layers` > 0: wrap
    token-by-token generation in it, so the compiled graphs stay those of the training and scoring forwards."""
    if not compiled_layers:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield
