"""The backends' four ops as `torch.library` custom ops, which is how FP8 layers run under `torch.compile`.

Dynamo then sees each quantization and each GEMM as one opaque op with a known output layout (the fake functions
below) instead of tracing into Triton launches, device guards and cuBLAS argument checks, and AOTAutograd compiles a
layer's forward and backward around them: no Python autograd node per layer, no Python glue between the launches.
In eager mode the layers call the backend modules directly, since a custom op's dispatch costs host time of its own.

`traceable(ops)` gives the same interface as a backend module (`quantize_act`, `quantize_swiglu`, `quantize_weight`,
`gemm`; see `trl_fp8.ops`), each call going through the op of that backend: same functions, same results.
"""

from __future__ import annotations

import importlib
from functools import partial
from types import ModuleType

import torch
from torch import Tensor

from ..quantization import QuantizedAct

__all__ = ["traceable"]


def _backend(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def _pack(act: QuantizedAct, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A custom op returns tensors only: an absent layout becomes an empty placeholder (read back as None)."""
    return tuple(t if t is not None else like.new_empty(0) for t in act)


def _unpack(out, rows: bool, cols: bool) -> QuantizedAct:
    q, s, qt, st = out
    return QuantizedAct(q if rows else None, s if rows else None, qt if cols else None, st if cols else None)


def _fake_act(backend: str, quantize, m: int, k: int, rows: bool, cols: bool, device) -> QuantizedAct:
    """What `backend`'s quantizer returns, as fake tensors: the emulation runs as it is (plain torch ops, which fake
    tensors carry through); the Triton quantizers' buffers come from the allocator they use."""
    if backend == "emulated":
        return quantize()
    from ..kernels._common import empty_act_layouts

    return empty_act_layouts(m, k, rows, cols, device)


@torch.library.custom_op("trl_fp8::quantize_act", mutates_args=())
def quantize_act_op(
    x: Tensor, backend: str, rows: bool, cols: bool, pow2: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _pack(_backend(backend).quantize_act(x, rows=rows, cols=cols, power_of_two_scales=pow2), x)


@quantize_act_op.register_fake
def _(x, backend, rows, cols, pow2):
    run = partial(_backend(backend).quantize_act, x, rows=rows, cols=cols, power_of_two_scales=pow2)
    return _pack(_fake_act(backend, run, x.shape[0], x.shape[1], rows, cols, x.device), x)


@torch.library.custom_op("trl_fp8::quantize_swiglu", mutates_args=())
def quantize_swiglu_op(
    gate: Tensor, up: Tensor, backend: str, rows: bool, cols: bool, pow2: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _pack(_backend(backend).quantize_swiglu(gate, up, rows=rows, cols=cols, power_of_two_scales=pow2), gate)


@quantize_swiglu_op.register_fake
def _(gate, up, backend, rows, cols, pow2):
    run = partial(_backend(backend).quantize_swiglu, gate, up, rows=rows, cols=cols, power_of_two_scales=pow2)
    return _pack(_fake_act(backend, run, gate.shape[0], gate.shape[1], rows, cols, gate.device), gate)


@torch.library.custom_op("trl_fp8::quantize_weight", mutates_args=())
def quantize_weight_op(w: Tensor, backend: str, col_major: bool, pow2: bool) -> tuple[Tensor, Tensor]:
    return _backend(backend).quantize_weight(w, col_major=col_major, power_of_two_scales=pow2)


@quantize_weight_op.register_fake
def _(w, backend, col_major, pow2):
    if backend == "emulated":  # (see _fake_act)
        return _backend(backend).quantize_weight(w, col_major=col_major, power_of_two_scales=pow2)
    from ..kernels.weight_quant import empty_weight_layout

    return empty_weight_layout(*w.shape, col_major, w.device)


@torch.library.custom_op("trl_fp8::gemm", mutates_args=())
def gemm_op(
    a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, backend: str, b_blocks: bool, out_dtype: torch.dtype
) -> Tensor:
    out = _backend(backend).gemm(a_q, a_s, b_q, b_s, b_blocks, out_dtype)
    # (an output must not alias an input; cuBLAS and the emulation return fresh tensors, this keeps it so)
    return out if out._base is None else out.clone()


@gemm_op.register_fake
def _(a_q, a_s, b_q, b_s, backend, b_blocks, out_dtype):
    return a_q.new_empty(a_q.shape[0], b_q.shape[0], dtype=out_dtype)


class _TraceableOps:
    """A backend module's interface over the custom ops above (see the module docstring)."""

    def __init__(self, backend: str):
        self.backend = backend

    def quantize_act(self, x, *, rows=True, cols=False, power_of_two_scales=False) -> QuantizedAct:
        return _unpack(quantize_act_op(x, self.backend, rows, cols, power_of_two_scales), rows, cols)

    def quantize_swiglu(self, gate, up, *, rows=True, cols=False, power_of_two_scales=False) -> QuantizedAct:
        return _unpack(quantize_swiglu_op(gate, up, self.backend, rows, cols, power_of_two_scales), rows, cols)

    def quantize_weight(self, w, *, col_major=False, power_of_two_scales=False):
        return quantize_weight_op(w, self.backend, col_major, power_of_two_scales)

    def gemm(self, a_q, a_s, b_q, b_s, b_blocks: bool, out_dtype: torch.dtype):
        return gemm_op(a_q, a_s, b_q, b_s, self.backend, b_blocks, out_dtype)


def traceable(ops: ModuleType) -> _TraceableOps:
    """`ops` (a backend module of `trl_fp8.ops`) as custom ops: what FP8 layers use inside `torch.compile`."""
    return _TraceableOps(ops.__name__.rpartition(".")[2])
