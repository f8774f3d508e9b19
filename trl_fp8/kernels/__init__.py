"""Triton kernels behind the GPU backend (`trl_fp8.ops.scaled_mm`): one op per file, each bit for bit equal to the
reference quantizers in `trl_fp8.quantization` (tests run them on the GPU, and on CPU in Triton's interpreter).

- `act_quant.quantize_act`: 1x128 groups of an activation or output gradient, in the layouts FProp/DGrad (groups
  along K) and WGrad (groups along tokens) need, both from one read of the tensor.
- `swiglu_quant.quantize_swiglu`: the gated MLP's `silu(gate) * up`, quantized like `act_quant` for `down_proj`,
  without writing the product.
- `weight_quant.quantize_weight`: 128x128 blocks of a weight, row-major (FProp, vLLM sync, export) or
  column-major (DGrad's operand); `transpose_expert_weights` moves experts' cached row-major blocks into DGrad's
  layout (the same bytes as re-quantizing).
- `grouped_gemm.m_grouped_gemm` / `k_grouped_gemm`: a mixture-of-experts projection's FProp and DGrad (rows grouped
  by expert) and WGrad (tokens grouped by expert) for all experts in one launch each, on the layout `GroupedRows`
  (each expert's rows padded to a multiple of 128). Equal to the emulation up to fp32 rounding, not bit for bit.
- `vllm_silu_mul_quant.silu_and_mul_per_block_quant`: vLLM's fused SiLU-and-mul + 1x128 FP8 quantization, vLLM's
  bits from a kernel that runs near its bytes, for the rollout engine (`trl_fp8.rollout.vllm.act_quant`), not for
  training.
- `vllm_rms_norm_quant.rms_norm_per_block_quant`: vLLM's fused RMSNorm (+ residual add) + 1x128 FP8 quantization,
  vLLM's bits (its order of summation included) from one read of the row, for the rollout engine
  (`trl_fp8.rollout.vllm.norm_quant`).
- `moe_combine.combine_rows`: each token's k expert rows weighted by the router and summed, forward and backward in
  one pass each (the eager chain's values; the router weights' gradient summed in fp32).

Each has one fixed launch configuration (quantization is a single memory-bound pass, so there is nothing to
autotune; the grouped GEMMs pick their tile height from the padding), and a new token count costs no tuning run.
"""

from trl_fp8.kernels.act_quant import quantize_act
from trl_fp8.kernels.grouped_gemm import GroupedRows, k_grouped_gemm, m_grouped_gemm
from trl_fp8.kernels.moe_combine import combine_rows, combine_rows_backward
from trl_fp8.kernels.swiglu_quant import quantize_swiglu
from trl_fp8.kernels.weight_quant import quantize_weight

__all__ = [
    "GroupedRows",
    "combine_rows",
    "combine_rows_backward",
    "k_grouped_gemm",
    "m_grouped_gemm",
    "quantize_act",
    "quantize_swiglu",
    "quantize_weight",
]
