"""Our quantization kernels against their floor: bytes moved over HBM bandwidth.

Each kernel is one memory-bound pass: it reads the BF16 tensor once and writes 1 byte per element per layout plus
fp32 scales, so its floor is `bytes / HBM bandwidth`. This measures `trl_fp8.kernels` at the Qwen3-8B operand
shapes (M tokens), per layout (FProp's rows, WGrad's cols, both from one read; "/2nd": the cols layout from a
second, K-major read of the tile) and per launch width (`num_warps`), neither of which changes the result, and
prints the share of the floor each reaches: what the quantization inside `bench_linear`'s FP8 layer could still
give back. Also the gated MLP's `silu(gate) * up` quantized for `down_proj` (`quantize_swiglu`, one read of gate
and up, both layouts written, no BF16 product) against eager's silu, product and quantization passes, each against
its own floor. And vLLM's fused `silu_and_mul_per_block_quant` (what a block-FP8 engine runs before `down_proj`)
against trl-fp8's kernel of the same bits (`trl_fp8.kernels.vllm_silu_mul_quant`), at decode batches of the 8B and
1.7B MLPs and the routed rows of Qwen3-30B-A3B's experts (where vLLM is installed; `--vllm_act_quant_only` for these
rows alone).

    python -m benchmarks.bench_quant [--tokens 8192] [--num_warps 4 8 16] [--vllm_act_quant_only] [--out results.json]
"""

from __future__ import annotations

import traceback
from functools import partial

import torch

from benchmarks.bench_linear import QWEN3_8B, bench
from benchmarks.common import arg_parser, metadata, results_path, write_json

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def act_bytes(m: int, k: int, rows: bool, cols: bool) -> int:
    """BF16 read + one e4m3 byte per element and one fp32 scale per 128 elements, per layout written."""
    m_pad = -(-m // 128) * 128
    return 2 * m * k + (rows + cols) * (m_pad * k + 4 * m_pad * k // 128)


def swiglu_bytes(m: int, i: int, fused: bool) -> int:
    """Fused: gate and up read, both FP8 layouts written. Eager: silu (read gate, write s), the product (read s and
    up, write h), then the quantization of h (`act_bytes`)."""
    if fused:
        return act_bytes(m, i, True, True) + 2 * m * i
    return 4 * m * i + 6 * m * i + act_bytes(m, i, True, True)


def weight_bytes(n: int, k: int) -> int:
    return 2 * n * k + n * k + 4 * -(-n // 128) * -(-k // 128)


def timed_row(row: dict, fn, nbytes: int, reps: int, hbm: float | None, timer=None) -> dict:
    """`row` with fn's time, its bandwidth and its share of the HBM floor (or the error, and the sweep goes on).
    `timer(fn, reps)` gives microseconds a call; default `bench_linear.bench`'s CUDA-event timing of eager calls."""
    try:
        row["us"] = timer(fn, reps) if timer is not None else 1e3 * bench(fn, reps, True)
        row["bytes"] = nbytes
        row["tb_per_s"] = nbytes / row["us"] / 1e6
        if hbm:
            row["floor_us"] = nbytes / hbm * 1e6
            row["of_floor"] = row["floor_us"] / row["us"]
    except Exception:  # noqa: BLE001 - recorded, the sweep goes on
        row["error"] = traceback.format_exc(-1)
    return row


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/quant_<device>.json")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--num_warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument(
        "--vllm_act_quant_only", action="store_true", help="only vLLM's SiLU-and-mul quantization rows"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks.bench_quant times the Triton kernels on a GPU; on CPU, tests/test_kernels.py checks them"
        )
    from trl_fp8.kernels import quantize_act, quantize_weight

    device = torch.cuda.get_device_name()
    hbm = next((v for key, v in HBM_BYTES_PER_S.items() if key in device), None)
    m = args.tokens
    # x [M, K] feeds FProp and WGrad; dy [M, N] feeds DGrad and WGrad; W [N, K] both weight layouts.
    operands = {}
    for k, n, label in QWEN3_8B:
        if isinstance(n, int):
            operands.setdefault(("act", m, k), f"x of {label}")
            operands.setdefault(("act", m, n), f"dy of {label}")
            operands.setdefault(("weight", n, k), f"W of {label}")
    # (label, rows or col_major, cols, cols_second_read)
    layouts = {"act": [("rows", True, False, False), ("cols", False, True, False), ("both", True, True, False),
                       ("cols/2nd", False, True, True), ("both/2nd", True, True, True)],
               "weight": [("row-major", False, None, None), ("col-major", True, None, None)]}  # fmt: skip
    rows = []
    for (kind, a, b), label in ({} if args.vllm_act_quant_only else operands).items():
        t = torch.randn(a, b, device="cuda", dtype=torch.bfloat16)
        for layout, first, second, second_read in layouts[kind]:
            for warps in args.num_warps:
                row = {"tensor": label, "kind": kind, "shape": [a, b], "layout": layout, "num_warps": warps}
                if kind == "act":
                    fn = partial(
                        quantize_act, t, rows=first, cols=second, num_warps=warps, cols_second_read=second_read
                    )
                    nbytes = act_bytes(a, b, first, second)
                else:
                    fn = partial(quantize_weight, t, col_major=first, num_warps=warps)
                    nbytes = weight_bytes(a, b)
                rows.append(timed_row(row, fn, nbytes, args.reps, hbm))
        del t
    if not args.vllm_act_quant_only:
        rows += swiglu_rows(m, hbm, args.reps)
    rows += vllm_act_quant_rows(hbm, args.reps)
    print(f"\nQuantization kernels, M={m}, {device}: microseconds, TB/s, share of the HBM floor")
    print(f"{'tensor':<22}{'shape':>14}{'layout':>11}{'warps':>6}{'us':>9}{'TB/s':>7}{'floor us':>9}{'of floor':>9}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{r['tensor']:<22}{shape:>14}{r['layout']:>11}{r['num_warps']:>6}  failed: {r['error'][:60]}")
            continue
        floor = f"{r['floor_us']:>9.1f}{r['of_floor']:>9.0%}" if hbm else ""
        print(
            f"{r['tensor']:<22}{shape:>14}{r['layout']:>11}{r['num_warps']:>6}{r['us']:>9.1f}{r['tb_per_s']:>7.2f}{floor}"
        )
    result = {
        "benchmark": "trl_fp8.kernels quantization: time against the HBM floor, per layout and num_warps",
        **metadata(device),
        "tokens": m,
        "hbm_bytes_per_s": hbm,
        "results": rows,
    }
    print(f"wrote {write_json(results_path(args.out, 'quant', device), result)}")


def swiglu_rows(m: int, hbm: float | None, reps: int) -> list[dict]:
    """`quantize_swiglu` against eager (`F.silu(gate) * up`, then `quantize_act`) at Qwen3-8B's intermediate size,
    gate and up as the two halves of one gate_up output."""
    import torch.nn.functional as F

    from trl_fp8.kernels import quantize_act, quantize_swiglu

    inter = 12288
    gate_up = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    variants = {
        "fused": (partial(quantize_swiglu, gate, up, rows=True, cols=True), True),
        "eager": (lambda: quantize_act(F.silu(gate) * up, rows=True, cols=True), False),
    }
    rows = []
    for layout, (fn, fused) in variants.items():
        row = {"tensor": "silu(gate)*up of down_proj", "kind": "swiglu", "shape": [m, inter], "layout": layout,
               "num_warps": 4}  # fmt: skip
        rows.append(timed_row(row, fn, swiglu_bytes(m, inter, fused), reps, hbm))
    return rows


# (label, tokens, MLP width): decode steps of 64-512 sequences at Qwen3-8B's and 1.7B's MLP widths, a prefill chunk
# of TRL's 4096 tokens, and Qwen3-30B-A3B's experts (8 routed rows per token, width 768).
VLLM_ACT_QUANT_SHAPES = [("8b decode", m, 12288) for m in (64, 128, 256, 512)] + [
    ("8b prefill", 4096, 12288), ("1.7b decode", 256, 6144), ("30b-a3b experts", 8 * 256, 768),
]  # fmt: skip


def vllm_act_quant_rows(hbm: float | None, reps: int) -> list[dict]:
    """vLLM's `silu_and_mul_per_block_quant` against trl-fp8's kernel of the same bits, scales in DeepGEMM's
    transposed layout as the DeepGEMM engine asks for them, each timed in a CUDA graph (`act_quant.graph_time_us`:
    the GPU's time, not the host's launches, as in a decode step); the bytes are the same for both (gate and up
    read, FP8 values and fp32 scales written). Rows are skipped without vLLM, or where the two differ in a bit."""
    try:
        from trl_fp8.rollout.vllm.act_quant import OP_NAME, first_difference, graph_time_us, run_op, vllm_kernel_op
    except ImportError:
        return []
    vllm_op = vllm_kernel_op()
    if vllm_op is None:
        print(f"vLLM's {OP_NAME} is not here: its rows are skipped")
        return []
    from trl_fp8.kernels.vllm_silu_mul_quant import silu_and_mul_per_block_quant

    rows = []
    for label, m, n in VLLM_ACT_QUANT_SHAPES:
        x = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16)
        same = first_difference("ieee", vllm_op, [(x, 128, None, True)])
        kernels = {"vllm": vllm_op, "trl_fp8": partial(silu_and_mul_per_block_quant, numerics="ieee")}
        for name, op in kernels.items():
            row = {"tensor": f"silu_and_mul_per_block_quant, {label}", "kind": "vllm_act_quant", "shape": [m, n],
                   "layout": name, "num_warps": 4, "same_bits": same is None}  # fmt: skip
            fn, nbytes = partial(run_op, op, x, 128, None, True), 5 * m * n + 4 * m * n // 128
            rows.append(timed_row(row, fn, nbytes, reps, hbm, timer=graph_time_us))  # GPU time, as in a decode step
    return rows


if __name__ == "__main__":
    main()
