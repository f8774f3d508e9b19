"""The backends' four ops as `torch.library` ops, which is how FP8 layers run under `torch.compile`.

Dynamo then sees each quantization and each GEMM as one op with a known output layout (the fake functions below)
instead of tracing into Triton launches, device guards and cuBLAS argument checks, and AOTAutograd compiles a
layer's forward and backward around them: no Python autograd node per layer, no Python glue between the launches.
In eager mode the layers call the backend modules directly, since an op's dispatch costs host time of its own.

`traceable(name)` gives the same interface as a backend module (`quantize_act`, `quantize_swiglu`, `quantize_weight`,
`gemm`; see `trl_fp8.ops`) for use inside `torch.compile`. The GPU backends' quantizers are `ops.triton_ops` (Triton
kernels that Inductor launches from its generated code); everything else goes through the ops defined here, whose
Python bodies run the backend's own functions: same functions, same results. They are defined with `Library.define`,
not `torch.library.custom_op`, whose Python dispatch costs about four times the host time per call.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from trl_fp8.quantization import QuantizedAct

__all__ = ["traceable"]


_lib = torch.library.Library("trl_fp8", "FRAGMENT")
_QUANTIZED = "(Tensor, Tensor, Tensor, Tensor)"
_lib.define(f"quantize_act(Tensor x, str backend, bool rows, bool cols, bool pow2) -> {_QUANTIZED}")
_lib.define(f"quantize_swiglu(Tensor gate, Tensor up, str backend, bool rows, bool cols, bool pow2) -> {_QUANTIZED}")
_lib.define("quantize_weight(Tensor w, str backend, bool col_major, bool pow2) -> (Tensor, Tensor)")
_lib.define(
    "gemm(Tensor a_q, Tensor a_s, Tensor b_q, Tensor b_s, str backend, bool b_blocks, ScalarType out_dtype) -> Tensor"
)


def _backend(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def _quantize_act(x, backend, rows, cols, pow2):
    return _backend(backend).quantize_act(x, rows=rows, cols=cols, power_of_two_scales=pow2).as_op_outputs(x)


def _quantize_swiglu(gate, up, backend, rows, cols, pow2):
    act = _backend(backend).quantize_swiglu(gate, up, rows=rows, cols=cols, power_of_two_scales=pow2)
    return act.as_op_outputs(gate)


def _quantize_weight(w, backend, col_major, pow2):
    return _backend(backend).quantize_weight(w, col_major=col_major, power_of_two_scales=pow2)


def _gemm(a_q, a_s, b_q, b_s, backend, b_blocks, out_dtype):
    out = _backend(backend).gemm(a_q, a_s, b_q, b_s, b_blocks, out_dtype)
    # (an output must not alias an input; cuBLAS and the emulation return fresh tensors, this keeps it so)
    return out if out._base is None else out.clone()


# Fakes: what the backend returns, as fake tensors. The emulation runs as it is (plain torch ops, which fake tensors
# carry through); the Triton quantizers' buffers come from the allocators the kernels use.
def _fake_quantize_act(x, backend, rows, cols, pow2):
    if backend == "emulated":
        return _quantize_act(x, backend, rows, cols, pow2)
    from trl_fp8.kernels._common import empty_act_layouts

    return empty_act_layouts(x.shape[0], x.shape[1], rows, cols, x.device).as_op_outputs(x)


def _fake_quantize_swiglu(gate, up, backend, rows, cols, pow2):
    if backend == "emulated":
        return _quantize_swiglu(gate, up, backend, rows, cols, pow2)
    return _fake_quantize_act(gate, backend, rows, cols, pow2)


def _fake_quantize_weight(w, backend, col_major, pow2):
    if backend == "emulated":
        return _quantize_weight(w, backend, col_major, pow2)
    from trl_fp8.kernels.weight_quant import empty_weight_layout

    return empty_weight_layout(*w.shape, col_major, w.device)


def _fake_gemm(a_q, a_s, b_q, b_s, backend, b_blocks, out_dtype):
    return a_q.new_empty(a_q.shape[0], b_q.shape[0], dtype=out_dtype)


for _name, _impl, _fake in [
    ("quantize_act", _quantize_act, _fake_quantize_act),
    ("quantize_swiglu", _quantize_swiglu, _fake_quantize_swiglu),
    ("quantize_weight", _quantize_weight, _fake_quantize_weight),
    ("gemm", _gemm, _fake_gemm),
]:
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"trl_fp8::{_name}", _fake, lib=_lib)

_ops = torch.ops.trl_fp8
gemm_op = _ops.gemm.default


class _OpInterface:
    """A backend module's interface over the ops above."""

    def __init__(self, backend: str):
        self.backend = backend

    def quantize_act(self, x, *, rows=True, cols=False, power_of_two_scales=False):
        out = _ops.quantize_act.default(x, self.backend, rows, cols, power_of_two_scales)
        return QuantizedAct.from_op_outputs(out, rows, cols)

    def quantize_swiglu(self, gate, up, *, rows=True, cols=False, power_of_two_scales=False):
        out = _ops.quantize_swiglu.default(gate, up, self.backend, rows, cols, power_of_two_scales)
        return QuantizedAct.from_op_outputs(out, rows, cols)

    def quantize_weight(self, w, *, col_major=False, power_of_two_scales=False):
        return _ops.quantize_weight.default(w, self.backend, col_major, power_of_two_scales)

    def gemm(self, a_q, a_s, b_q, b_s, b_blocks: bool, out_dtype: torch.dtype):
        return gemm_op(a_q, a_s, b_q, b_s, self.backend, b_blocks, out_dtype)


class _TritonInterface(_OpInterface):
    """A GPU backend's: our Triton quantizers as `triton_op`s (`ops.triton_ops`), the backend's GEMM through the op."""

    def __init__(self, backend: str):
        from trl_fp8.ops import triton_ops  # (imports Triton: only where a GPU backend was selected)

        super().__init__(backend)
        self.kernels = triton_ops

    def quantize_act(self, x, *, rows=True, cols=False, power_of_two_scales=False):
        return self.kernels.quantize_act(x, rows=rows, cols=cols, power_of_two_scales=power_of_two_scales)

    def quantize_swiglu(self, gate, up, *, rows=True, cols=False, power_of_two_scales=False):
        return self.kernels.quantize_swiglu(gate, up, rows=rows, cols=cols, power_of_two_scales=power_of_two_scales)

    def quantize_weight(self, w, *, col_major=False, power_of_two_scales=False):
        return self.kernels.quantize_weight(w, col_major=col_major, power_of_two_scales=power_of_two_scales)


def traceable(backend: str) -> _OpInterface:
    """The backend module of `trl_fp8.ops` named `backend` (`ops.backend_name`, `ops.select_backend_name`) as FP8
    layers use it inside `torch.compile`."""
    return _OpInterface(backend) if backend == "emulated" else _TritonInterface(backend)
