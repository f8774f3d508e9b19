"""The three blockwise FP8 GEMMs of one linear layer at Qwen3-8B shapes: cuBLAS `scaled_mm` (what FP8Linear runs)
against vLLM's bundled DeepGEMM, and BF16 `mm`, side by side in one run; each checked against the fp32 emulation.

    python -m benchmarks.bench_gemm                 # SM90 GPU with vLLM installed (DeepGEMM compiles with nvcc)
    python -m benchmarks.bench_gemm --quick         # CPU: the emulated reference only, tiny shapes (plumbing check)

GEMMs (M tokens, layer [N, K]): FProp `x @ W.T` and DGrad `dy @ W` take 1x128 x 128x128 operands; WGrad
`dy.T @ x` takes 1x128 x 1x128 operands grouped along the tokens (DeepGEMM's "1D1D" kernel). Floors: FLOPs over
the FP8 / BF16 tensor-core peak of the data sheet. A variant that fails records its error instead of a time.
Writes `benchmarks/results/gemm_<device>.json`.
"""

from __future__ import annotations

import traceback

import torch

from benchmarks.bench_linear import QWEN3_8B, bench
from benchmarks.common import arg_parser, device_name, metadata, results_path, write_json
from trl_fp8.ops import emulated

PEAK = {"H200": {"bf16": 989e12, "fp8": 1979e12}, "H100": {"bf16": 989e12, "fp8": 1979e12}}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def operands(m, n, k, device, ops):
    """The FP8 operands of the three GEMMs, from our quantizers (what FP8Linear hands the GEMM)."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16) * 1e-3
    xa = ops.quantize_act(x, rows=True, cols=True)
    ga = ops.quantize_act(dy, rows=True, cols=True)
    wq, ws = ops.quantize_weight(w)
    wdq, wds = ops.quantize_weight(w, col_major=True)
    return {
        "fprop": (xa.q, xa.scale_inv, wq, ws, True),
        "dgrad": (ga.q, ga.scale_inv, wdq.t(), wds.t(), True),
        "wgrad": (ga.qt, ga.scale_inv_t, xa.qt, xa.scale_inv_t, False),
        "bf16": {"fprop": (x, w), "dgrad": (dy, w.t()), "wgrad": (dy.t(), x.t())},
    }


def deepgemm_call(a_q, a_s, b_q, b_s, b_blocks):
    """`a @ b.T` on vLLM's DeepGEMM (SM90, fp32 scales, no E8M0). 128x128 B scales go through vLLM's own weight
    post-processing; 1x128 scales of either operand through DeepGEMM's MN-major TMA-aligned layout."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_fp8_weight_block
    from vllm.utils.deep_gemm import fp8_gemm_nt, get_col_major_tma_aligned_tensor

    a_q = a_q.contiguous()
    a_s = get_col_major_tma_aligned_tensor(a_s.contiguous())
    b_q = b_q.contiguous()
    if b_blocks:
        b_q, b_s = deepgemm_post_process_fp8_weight_block(b_q, b_s.contiguous(), (128, 128), use_e8m0=False)
        out_dtype = torch.bfloat16
    else:
        b_s = get_col_major_tma_aligned_tensor(b_s.contiguous())
        out_dtype = torch.float32  # DeepGEMM's 1D1D (WGrad) kernel accumulates into fp32
    out = torch.zeros(a_q.shape[0], b_q.shape[0], device=a_q.device, dtype=out_dtype)

    # DeepGEMM infers the recipe from the scale dtypes, as (1, 128, 128) for fp32 scales: WGrad's 1x128-by-1x128
    # operands must name theirs (1, 1, 128). Its SM90 1D1D kernel only accumulates (d = c + a @ b.T, fp32), which
    # is what a weight gradient does; `out` starts at zero, so the first call (the one checked) is the plain GEMM.
    extra = {} if b_blocks else {"recipe": (1, 1, 128), "c": out}

    def run():
        fp8_gemm_nt((a_q, a_s), (b_q, b_s), out, is_deep_gemm_e8m0_used=False, **extra)
        return out

    return run


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/gemm_<device>.json; with --quick, only with --out",
                        quick="the emulated reference alone at a tiny shape, for a CPU smoke run")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    label = device_name()
    peak = next((v for k, v in PEAK.items() if k in label), None)
    from trl_fp8 import FP8LinearConfig
    from trl_fp8.ops import select_ops

    ops = select_ops(FP8LinearConfig(), torch.device(device))
    shapes = [(256, 384, "tiny")] if args.quick else [(k, n, label) for k, n, label in QWEN3_8B if isinstance(n, int)]
    m = 256 if args.quick else args.tokens
    rows = []
    for k, n, label in shapes:
        ops_by_gemm = operands(m, n, k, device, ops)
        for gemm in ("fprop", "dgrad", "wgrad"):
            a_q, a_s, b_q, b_s, b_blocks = ops_by_gemm[gemm]
            ref = emulated.gemm(a_q, a_s, b_q, b_s, b_blocks, torch.float32)
            mm, nn_, kk = ref.shape[0], ref.shape[1], a_q.shape[1]
            flops = 2 * mm * nn_ * kk
            a, b = ops_by_gemm["bf16"][gemm]
            candidates = {"bf16 mm": lambda a=a, b=b: a @ b.t()}
            if cuda:
                candidates["cuBLAS scaled_mm"] = lambda g=(a_q, a_s, b_q, b_s, b_blocks): ops.gemm(*g, torch.bfloat16)
                try:
                    candidates["DeepGEMM"] = deepgemm_call(a_q, a_s, b_q, b_s, b_blocks)
                except Exception:  # noqa: BLE001 - recorded, the run goes on
                    rows.append(
                        {"shape": label, "gemm": gemm, "variant": "DeepGEMM", "error": traceback.format_exc(-1)}
                    )
            else:
                candidates["emulated"] = lambda g=(a_q, a_s, b_q, b_s, b_blocks): emulated.gemm(*g, torch.float32)
            for variant, fn in candidates.items():
                row = {"shape": label, "gemm": gemm, "variant": variant, "M": mm, "N": nn_, "K": kk}
                try:
                    out = fn()
                    if variant != "bf16 mm":
                        row["rel_err_vs_emulation"] = rel_err(out, ref)
                    row["ms"] = bench(fn, args.reps, cuda)
                    row["tflops"] = flops / row["ms"] / 1e9
                    if peak:
                        row["of_peak"] = flops / (row["ms"] / 1e3) / peak["bf16" if variant == "bf16 mm" else "fp8"]
                except Exception:  # noqa: BLE001
                    row["error"] = traceback.format_exc(-1)
                rows.append(row)
    for r in rows:
        base = next((x["ms"] for x in rows if x["shape"] == r["shape"] and x["gemm"] == r["gemm"]
                     and x["variant"] == "bf16 mm" and "ms" in x), None)  # fmt: skip
        if "ms" in r and base:
            r["speedup_vs_bf16"] = base / r["ms"]
    print(f"\nFP8 GEMMs, M={m}, {label}")
    print(f"{'shape':<14}{'gemm':<7}{'variant':<18}{'ms':>9}{'TFLOP/s':>9}{'of peak':>9}{'vs bf16':>9}{'rel err':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<14}{r['gemm']:<7}{r['variant']:<18} failed: {r['error'].strip().splitlines()[-1]}")
            continue
        print(f"{r['shape']:<14}{r['gemm']:<7}{r['variant']:<18}{r['ms']:>9.3f}{r['tflops']:>9.0f}"
              f"{r.get('of_peak', float('nan')):>9.0%}{r.get('speedup_vs_bf16', float('nan')):>8.2f}x"
              f"{r.get('rel_err_vs_emulation', float('nan')):>10.1e}")  # fmt: skip
    if not args.quick or args.out:
        result = {"benchmark": "blockwise FP8 GEMMs", **metadata(label), "tokens": m, "results": rows}
        print(f"wrote {write_json(results_path(args.out, 'gemm', label), result)}")


if __name__ == "__main__":
    main()
