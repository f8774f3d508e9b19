"""FProp and DGrad on DeepGEMM (vLLM's bundled copy); the quantizers and WGrad as in `scaled_mm`.

DeepGEMM's 1x128 x 128x128 kernel is faster than cuBLAS's blockwise `scaled_mm` on the same operands, to the same
error against the exact emulation (`benchmarks/bench_gemm.py`; docs/contributing/benchmark-details.md). Its SM90
WGrad kernel (1x128 x 1x128) only accumulates into an fp32 output, so WGrad stays on cuBLAS here. The operands come
in DeepGEMM's layouts: A row-major with MN-major scales (our quantizers write them so), B K-major (`[N, K]` for FProp;
the column-major DGrad weight read as `W.T`) with `[N/128, K/128]` fp32 scales, passed through vLLM's own
weight-scale preparation.

The GPU suite checks it against the emulation. Besides a faster layer, it costs just-in-time compiles in the first
training step (the DGrad shapes are new to the rollout engine's kernel cache; `bench_linear.py` and `bench_grpo.py`
measure both, docs/contributing/benchmark-details.md). It stays opt-in (`FP8LinearConfig(backend="deepgemm")`)
until the GPU suite runs with it as the default.
"""

from __future__ import annotations

import torch

from trl_fp8.config import BLOCK
from trl_fp8.ops import scaled_mm

quantize_act = scaled_mm.quantize_act
quantize_weight = scaled_mm.quantize_weight
quantize_swiglu = scaled_mm.quantize_swiglu


def available() -> str | None:
    """None when DeepGEMM can run here, else why not (with the fix)."""
    try:
        from vllm.utils.import_utils import has_deep_gemm
    except ImportError:
        return "backend='deepgemm' uses the DeepGEMM bundled with vLLM: pip install 'trl-fp8[vllm]'"
    if not has_deep_gemm():
        return "this vLLM build has no DeepGEMM (vllm.third_party.deep_gemm); use backend='scaled_mm'"
    return None


def gemm(a_q, a_s, b_q, b_s, b_blocks: bool, out_dtype: torch.dtype) -> torch.Tensor:
    if not b_blocks or out_dtype != torch.bfloat16:
        return scaled_mm.gemm(a_q, a_s, b_q, b_s, b_blocks, out_dtype)
    from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_fp8_weight_block
    from vllm.utils.deep_gemm import fp8_gemm_nt, get_col_major_tma_aligned_tensor

    b_q, b_s = deepgemm_post_process_fp8_weight_block(
        b_q.contiguous(), b_s.contiguous(), (BLOCK, BLOCK), use_e8m0=False
    )  # E8M0 off: our scales as they are, never rounded to powers of two
    out = torch.empty(a_q.shape[0], b_q.shape[0], device=a_q.device, dtype=out_dtype)
    fp8_gemm_nt(
        (a_q.contiguous(), get_col_major_tma_aligned_tensor(a_s)), (b_q, b_s), out, is_deep_gemm_e8m0_used=False
    )
    return out


def m_grouped_gemm(a_q, a_s, b_q, b_s, expert_of_row: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's m-grouped "contiguous" GEMM (what vLLM runs block-FP8 experts on): `out[r] = a[r] @ b[e].T` in
    BF16 for every row r of expert `e = expert_of_row[r]`, rows of -1 (padding) skipped and left unwritten.

    `a_q [M, K]` with 1x128 scales `a_s [M, K/128]`; `b_q [E, N, K]` contiguous (K-major) with 128x128 block scales
    `b_s [E, N/128, K/128]`; each expert's rows a contiguous run starting at a multiple of 128
    (`kernels.grouped_gemm.GroupedRows`). Scales stay float32 as given (never rounded to powers of two)."""
    import vllm.utils.deep_gemm as vdg

    vdg._lazy_init()
    # vLLM's public wrapper decides the E8M0 cast from its engine settings; ours are float32 scales, never cast.
    grouped = vdg._grouped_impl
    if grouped is None:
        raise RuntimeError("this vLLM's DeepGEMM has no m_grouped_fp8_gemm_nt_contiguous; use experts_gemm='triton'")
    out = torch.empty(a_q.shape[0], b_q.shape[1], device=a_q.device, dtype=torch.bfloat16)
    with vdg.mk_alignment_scope(BLOCK):  # the tile height may not exceed the block alignment of expert segments
        grouped((a_q, vdg.get_col_major_tma_aligned_tensor(a_s)), (b_q.contiguous(), b_s.contiguous()), out,
                expert_of_row, disable_ue8m0_cast=True)  # fmt: skip
    return out
