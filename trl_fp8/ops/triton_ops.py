"""The GPU backends' quantizers as `torch.compile` takes them: what FP8 layers call inside a compiled region.

They are `torch.library.triton_op`s: Inductor sees their Triton kernels and launches them from its
generated code, with neither a Python launcher nor a dispatcher round trip per call. The blockwise GEMM stays an op
with a Python body (`ops.library`, defined with `Library.define`, whose dispatch costs a fraction of
`torch.library.custom_op`'s: docs/contributing/changelog.md), because Dynamo in torch 2.11 cannot trace
`torch._scaled_mm_v2` (a graph break at every FP8 layer, slower than eager). Same kernels, same bits as eager.
"""

from __future__ import annotations

from torch import Tensor
from torch.library import triton_op

from trl_fp8 import kernels
from trl_fp8.quantization import QuantizedAct

__all__ = ["quantize_act", "quantize_swiglu", "quantize_weight"]


@triton_op("trl_fp8::triton_quantize_act", mutates_args=())
def _quantize_act(x: Tensor, rows: bool, cols: bool, pow2: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return kernels.quantize_act(x, rows=rows, cols=cols, power_of_two_scales=pow2, traced=True).as_op_outputs(x)


@triton_op("trl_fp8::triton_quantize_swiglu", mutates_args=())
def _quantize_swiglu(
    gate: Tensor, up: Tensor, rows: bool, cols: bool, pow2: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    act = kernels.quantize_swiglu(gate, up, rows=rows, cols=cols, power_of_two_scales=pow2, traced=True)
    return act.as_op_outputs(gate)


@triton_op("trl_fp8::triton_quantize_weight", mutates_args=())
def _quantize_weight(w: Tensor, col_major: bool, pow2: bool) -> tuple[Tensor, Tensor]:
    return kernels.quantize_weight(w, col_major=col_major, power_of_two_scales=pow2, traced=True)


def quantize_act(x, *, rows=True, cols=False, power_of_two_scales=False) -> QuantizedAct:
    return QuantizedAct.from_op_outputs(_quantize_act(x, rows, cols, power_of_two_scales), rows, cols)


def quantize_swiglu(gate, up, *, rows=True, cols=False, power_of_two_scales=False) -> QuantizedAct:
    return QuantizedAct.from_op_outputs(_quantize_swiglu(gate, up, rows, cols, power_of_two_scales), rows, cols)


def quantize_weight(w, *, col_major=False, power_of_two_scales=False):
    return _quantize_weight(w, col_major, power_of_two_scales)
