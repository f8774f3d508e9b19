"""Kernel layer: the operand quantizers and blockwise FP8 GEMMs behind `FP8Linear`, one backend per file.

Every backend exposes the same four functions, on logical (layout-free) tensors:

- `quantize_act(x, rows=True, cols=False)`: `x [M, K]` -> `QuantizedAct`: 1x128 groups along K (`rows`: `q [M_pad, K]`,
  `scale_inv [M_pad, K/128]`) and along tokens (`cols`: `qt [K, M_pad]`, `scale_inv_t [K, M_pad/128]`), from one read
  of `x`; `M_pad` is M rounded up to 128 with zero tokens.
- `quantize_swiglu(gate, up, rows=True, cols=False)`: `silu(gate) * up` quantized as `quantize_act` quantizes an
  activation, without writing the product (the gated MLP's `down_proj` input).
- `quantize_weight(w, col_major=False)`: `w [N, K]` -> `(q [N, K], scale_inv [N/128, K/128])`, 128x128 blocks,
  stored row-major (FProp, sync, export) or column-major (DGrad's `dy @ W` operand).
- `gemm(a_q, a_s, b_q, b_s, b_blocks, out_dtype)`: `a @ b.T` with fp32 accumulation, where `a` holds 1x128
  groups and `b` holds 128x128 blocks (`b_blocks=True`) or 1x128 groups along the shared dim.

`library.traceable(name)` is the same interface as `torch.compile` takes it (`torch.library` ops; the GPU backends'
quantizers as Triton ops, `triton_ops`): what FP8 layers call inside a compiled region.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

import torch

from trl_fp8.config import FP8LinearConfig
from trl_fp8.ops import emulated


def backend_name(ops: ModuleType) -> str:
    """`"emulated"`, `"scaled_mm"` or `"deep_gemm"`: which backend module `ops` (from `select_ops`) is."""
    return ops.__name__.rpartition(".")[2]


def blockwise_scaled_mm_supported(device: torch.device) -> bool:
    """Blockwise (1x128 x 128x128) `scaled_mm` exists only on CUDA SM90 (H100/H200) in current PyTorch."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


_warned_emulation: set[str] = set()


def _warn_emulated_gpu(device: torch.device) -> None:
    """`auto` on a CUDA GPU without blockwise FP8 GEMMs falls back to the fp32 emulation: correct, but slower than
    BF16. Say so once per GPU, loudly, with the ways out."""
    name = torch.cuda.get_device_name(device)
    if name in _warned_emulation:
        return
    _warned_emulation.add(name)
    major, minor = torch.cuda.get_device_capability(device)
    message = (
        f"trl-fp8: {name} (sm_{major}{minor}) has no blockwise FP8 GEMMs in PyTorch (they need SM90: H100/H200), so "
        "fp8_backend='auto' EMULATES the blockwise FP8 math in fp32 there: numerically the same, but slower than "
        "BF16. On this GPU use fp8_recipe='tensorwise' or 'rowwise' (torchao kernels, SM89+), or fp8_recipe=None "
        "for BF16; set fp8_backend='emulated' to silence this if emulation is what you want."
    )
    warnings.warn(message, stacklevel=3)


@torch.compiler.assume_constant_result
def select_backend_name(backend: str, device: torch.device) -> str:
    """`backend_name(select_ops(config, device))` for a config of this `backend` (`FP8LinearConfig.backend`, all that
    `select_ops` reads), for FP8 layers inside `torch.compile`: Dynamo calls it while tracing and keeps its answer,
    instead of tracing into the backend checks (traced, `deepgemm`'s lookup of vLLM's DeepGEMM broke the graph at every
    FP8 layer, and the compiled model ran slower than eager). It takes the string, not the config: torch 2.11's Dynamo
    cannot hand a frozen dataclass to a function whose result it keeps."""
    return backend_name(select_ops(FP8LinearConfig(backend=backend), device))


@functools.cache
def select_ops(config: FP8LinearConfig, device: torch.device) -> ModuleType:
    """The backend module that runs `config` on `device`."""
    if config.backend == "emulated" or (config.backend == "auto" and not blockwise_scaled_mm_supported(device)):
        if config.backend == "auto" and device.type == "cuda":
            _warn_emulated_gpu(device)
        return emulated
    if not blockwise_scaled_mm_supported(device):
        raise RuntimeError(
            f"backend={config.backend!r} needs a CUDA SM90 GPU (H100/H200) for blockwise FP8 GEMMs, but the weights "
            f"are on {device}. Use backend='auto' (emulates elsewhere) or move the model to an SM90 GPU."
        )
    if config.backend == "deepgemm":
        from trl_fp8.ops import deep_gemm

        if (why_not := deep_gemm.available()) is not None:
            raise RuntimeError(f"FP8LinearConfig(backend='deepgemm') cannot run: {why_not}.")
        return deep_gemm
    from trl_fp8.ops import scaled_mm  # imports the Triton kernels, so only where CUDA is there

    return scaled_mm
