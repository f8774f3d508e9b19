"""The grouped GEMMs of one mixture-of-experts projection, forward + backward (FProp, DGrad, WGrad over the routed
rows): BF16 `torch._grouped_mm` (what transformers' `grouped_mm` experts run) against our blockwise FP8
(`fp8_experts._GroupedExpertsFP8Matmul`: the padded layout, the 1x128 quantizations, the grouped kernels), at
Qwen3-30B-A3B's expert shapes (hidden 2048, intermediate 768, 128 experts, top-8) for 8k-64k routed rows.

    python -m benchmarks.bench_grouped_gemm                   # GPU host: 1k-8k tokens (8k-64k routed rows)
    python -m benchmarks.bench_grouped_gemm --sweep           # + launch configurations of the Triton kernels
    python -m benchmarks.bench_grouped_gemm --quick           # CPU smoke run (Triton's interpreter, tiny shape)

Each row holds both projections (`gate_up`: N 1536, K 2048; `down`: N 2048, K 768) and their sum, the FP8 time
with the expert weights already quantized (the weight cache holds them across a step's micro-batches) and with the
weight quantization counted, the GPU kernels by name (profiled), and the floor: every GEMM's operands read once and
its output written once over HBM bandwidth, or its FLOPs over the dense tensor-core peak, whichever is larger. The
FP8 kernels are also timed one by one (`kernels`), each against its own floor.
"""

from __future__ import annotations

import json
import time

import torch

from benchmarks.bench_rollout import hardware  # the data sheet's dense peaks and HBM bandwidth
from benchmarks.common import arg_parser, device_name, kernel_breakdown, metadata, results_path, write_json

SHAPE = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
TINY = dict(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)


def routing_counts(tokens: int, dims: dict, seed: int = 0) -> list[int]:
    """Rows per expert of a top-k over random router logits (uneven, as a router gives)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, dims["num_experts"], generator=g)
    index = torch.topk(logits, dims["num_experts_per_tok"], dim=-1).indices
    return torch.bincount(index.reshape(-1), minlength=dims["num_experts"]).tolist()


def time_ms(fn, cuda: bool, reps: int) -> float:
    """Mean milliseconds per call (CUDA events), after one warm-up call."""
    fn()
    if not cuda:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def profile_kernels(fn, top: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_breakdown(prof, top=top)


def floor_ms(flops: float, nbytes: float, peak: float, hbm: float) -> float:
    """Milliseconds: `flops` at the `peak` FLOP/s or `nbytes` at `hbm` bytes/s, whichever is longer."""
    return 1e3 * max(flops / peak, nbytes / hbm)


def projection_floors(rows: int, e: int, n: int, k: int, p: dict) -> dict:
    """fwd+bwd floors of one projection over `rows` routed rows: BF16 (2-byte operands) and FP8 (1-byte operands,
    fp32 scales ignored: under 1%), outputs in BF16 (WGrad writes every expert's `[N, K]` gradient)."""

    def three(opnd: int, peak: float) -> float:
        flops = 2.0 * rows * n * k  # each of the three GEMMs
        fprop = floor_ms(flops, opnd * (rows * k + e * n * k) + 2 * rows * n, peak, p["hbm"])
        dgrad = floor_ms(flops, opnd * (rows * n + e * n * k) + 2 * rows * k, peak, p["hbm"])
        wgrad = floor_ms(flops, opnd * (rows * n + rows * k) + 2 * e * n * k, peak, p["hbm"])
        return fprop + dgrad + wgrad

    return {"bf16_floor_ms": three(2, p["bf16"]), "fp8_floor_ms": three(1, p["fp8"])}


def operands(counts: list[int], n: int, k: int, device: str):
    """One projection's BF16 operands (weight `[E, N, K]` as a parameter, rows `x [M, K]`, output gradient
    `dy [M, N]`) and the routing counts on the device, as `FP8Experts` has them."""
    torch.manual_seed(0)
    m = sum(counts)
    weight = torch.nn.Parameter(torch.randn(len(counts), n, k, device=device, dtype=torch.bfloat16) * 0.02)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    return weight, x, dy, torch.tensor(counts, device=device)


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q [E, N, K], scale_inv [E, N/128, K/128])`: each expert's 128x128 blocks, as the weight cache holds them."""
    from trl_fp8.kernels import quantize_weight

    e, n, k = weight.shape
    q, s = quantize_weight(weight.detach().reshape(e * n, k))
    return q.view(e, n, k), s.view(e, n // 128, k // 128)


def bench_projection(name: str, counts: list[int], n: int, k: int, device: str, reps: int, p: dict | None) -> dict:
    from trl_fp8.kernels import GroupedRows
    from trl_fp8.nn.experts import _GroupedExpertsFP8Matmul, grouped_gemm_kernel

    cuda = device == "cuda"
    e, m = len(counts), sum(counts)
    weight, x, dy, counts_dev = operands(counts, n, k, device)
    offs = counts_dev.cumsum(0).to(torch.int32)

    def bf16_step():
        xg = x.detach().requires_grad_()
        torch._grouped_mm(xg, weight.transpose(-2, -1), offs=offs).backward(dy)
        weight.grad = None

    q, s = quantize_experts(weight)
    kernels = ["triton"] + (["deepgemm"] if grouped_gemm_kernel("auto", x) == "deepgemm" else [])

    def fp8_step(kernel: str, with_weight_quant: bool = False, grad: bool = True):
        rows = GroupedRows(counts_dev, x.device, num_rows=m)  # per layer call, as in `FP8Experts.forward`
        wq, ws = quantize_experts(weight) if with_weight_quant else (q, s)
        xg = x.detach().requires_grad_(grad)
        out = _GroupedExpertsFP8Matmul.apply(xg, weight, wq, ws, rows, kernel, False, grad)
        if grad:
            out.backward(dy)
            weight.grad = None
        return out

    row = {"projection": name, "n": n, "k": k, "fp8_kernels": kernels}
    if cuda:  # outputs against BF16, on the forward alone
        with torch.no_grad():
            ref = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs).float()
            for kernel in kernels:
                got = fp8_step(kernel, grad=False).float()
                row[f"fp8_{kernel}_rel_err_vs_bf16"] = float((got - ref).norm() / ref.norm())
        row["bf16_ms"] = time_ms(bf16_step, cuda, reps)
    for kernel in kernels:
        row[f"fp8_{kernel}_ms"] = time_ms(lambda kernel=kernel: fp8_step(kernel), cuda, reps)
        row[f"fp8_{kernel}_with_weight_quant_ms"] = time_ms(lambda kernel=kernel: fp8_step(kernel, True), cuda, reps)
        if cuda:
            row[f"fp8_{kernel}_profile"] = profile_kernels(lambda kernel=kernel: fp8_step(kernel))
    best = kernels[-1]  # what "auto" picks
    row["fp8_ms"], row["fp8_with_weight_quant_ms"] = row[f"fp8_{best}_ms"], row[f"fp8_{best}_with_weight_quant_ms"]
    if cuda:
        row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        row["bf16_profile"] = profile_kernels(bf16_step)
    if p:
        row.update(projection_floors(m, e, n, k, p))
        row["bf16_fraction_of_floor"] = row["bf16_floor_ms"] / row["bf16_ms"]
        row["fp8_fraction_of_floor"] = row["fp8_floor_ms"] / row["fp8_ms"]
    return row


def bench_kernels(counts: list[int], n: int, k: int, device: str, reps: int, p: dict | None, sweep: bool) -> list:
    """The FP8 projection's kernels one by one, each against its floor (and, with `sweep`, WGrad's launch
    configurations)."""
    from trl_fp8.kernels import GroupedRows, k_grouped_gemm, quantize_act, quantize_weight
    from trl_fp8.kernels.weight_quant import quantize_expert_weights_t, transpose_expert_weights
    from trl_fp8.nn.experts import _m_grouped, grouped_gemm_kernel

    cuda = device == "cuda"
    e, m = len(counts), sum(counts)
    weight, x, dy, counts_dev = operands(counts, n, k, device)
    weight = weight.detach()
    rows = GroupedRows(counts_dev, device, num_rows=m)
    q, s = quantize_experts(weight)
    xa = quantize_act(x, source_rows=rows.source, rows=True, cols=True)
    da = quantize_act(dy, source_rows=rows.source, rows=True, cols=True)
    wq_t, ws_t = quantize_expert_weights_t(weight)
    mp = rows.m_pad
    hbm = (p or {}).get("hbm")
    peak = (p or {}).get("fp8")
    out = []

    def add(label, fn, read, write, flops=0.0, **config):
        ms = time_ms(fn, cuda, reps)
        row = {"kernel": label, "ms": ms, **config}
        if hbm:
            row["floor_ms"] = floor_ms(flops, read + write, peak, hbm)
            row["fraction_of_floor"] = row["floor_ms"] / ms
        out.append(row)
        return row

    add("GroupedRows (layout, on the device)", lambda: GroupedRows(counts_dev, device, num_rows=m), 0, 0)
    add("quantize_act x rows+cols (gathered)", lambda: quantize_act(x, source_rows=rows.source, rows=True, cols=True),
        2 * m * k, 2 * mp * k)  # fmt: skip
    add("quantize_act dy rows+cols (gathered)",
        lambda: quantize_act(dy, source_rows=rows.source, rows=True, cols=True), 2 * m * n, 2 * mp * n)  # fmt: skip
    add("quantize_weight row-major", lambda: quantize_weight(weight.reshape(e * n, k)), 2 * e * n * k, e * n * k)
    add("quantize_expert_weights_t (DGrad)", lambda: quantize_expert_weights_t(weight), 2 * e * n * k, e * n * k)
    # DGrad's operand from the blocks the weight cache holds (what the layer does where the cache is on)
    add("transpose_expert_weights (DGrad, cached)", lambda: transpose_expert_weights(q, s), e * n * k, e * n * k)
    add("unpad (gather real rows)", lambda: rows.unpad(torch.empty(mp, n, device=device, dtype=torch.bfloat16)),
        2 * m * n, 2 * m * n)  # fmt: skip
    flops = 2.0 * rows.num_rows * n * k
    kernels = ["triton"] + (["deepgemm"] if cuda and grouped_gemm_kernel("auto", x) == "deepgemm" else [])
    results = {}
    for kernel in kernels:
        add(f"{kernel} m_grouped FProp", lambda kernel=kernel: _m_grouped(xa, q, s, rows, kernel, torch.bfloat16),
            mp * k + e * n * k, 2 * mp * n, flops)  # fmt: skip
        results[("fprop", kernel)] = _m_grouped(xa, q, s, rows, kernel, torch.bfloat16)[rows.dest].float()
        add(f"{kernel} m_grouped DGrad",
            lambda kernel=kernel: _m_grouped(da, wq_t, ws_t, rows, kernel, torch.bfloat16),
            mp * n + e * n * k, 2 * mp * k, flops)  # fmt: skip
        results[("dgrad", kernel)] = _m_grouped(da, wq_t, ws_t, rows, kernel, torch.bfloat16)[rows.dest].float()
    # DGrad reading the row-major blocks through strides (no transposed copy at all; Hopper's FP8 tensor cores read
    # K-major operands, so Triton has to transpose the tiles on the way): is it faster than the copy plus the GEMM?
    add("triton m_grouped DGrad, row-major blocks (strided)",
        lambda: _m_grouped(da, q.transpose(1, 2), s.transpose(1, 2), rows, "triton", torch.bfloat16),
        mp * n + e * n * k, 2 * mp * k, flops)  # fmt: skip
    strided = _m_grouped(da, q.transpose(1, 2), s.transpose(1, 2), rows, "triton", torch.bfloat16)[rows.dest].float()
    out.append({"kernel": "strided vs transposed triton dgrad", "max_rel_diff": float(
        (strided - results[("dgrad", "triton")]).abs().max() / results[("dgrad", "triton")].abs().max())})  # fmt: skip
    if len(kernels) > 1:
        for gemm in ("fprop", "dgrad"):
            ref, got = results[(gemm, "triton")], results[(gemm, "deepgemm")]
            out.append({"kernel": f"deepgemm vs triton {gemm}", "max_rel_diff": float((got - ref).abs().max() /
                        ref.abs().max())})  # fmt: skip
    wconfigs = [dict()]
    if sweep:
        wconfigs += [dict(block_n=bn, num_warps=w, num_stages=st) for bn in (64, 128) for w in (4, 8)
                     for st in (2, 3, 4) if not (bn == 128 and w == 4)]  # fmt: skip
        # one program per output tile over every group (k_grouped_gemm's `persistent`)
        wconfigs += [dict(block_n=bn, num_warps=w, num_stages=st, persistent=True) for bn in (64, 128)
                     for w in (4, 8) for st in (3, 4) if not (bn == 128 and w == 4)]  # fmt: skip
    for cfg in wconfigs:
        add("k_grouped WGrad", lambda cfg=cfg: k_grouped_gemm(da.qt, da.scale_inv_t, xa.qt, xa.scale_inv_t, rows,
            torch.bfloat16, **cfg), mp * (n + k), 2 * e * n * k, flops, **cfg)  # fmt: skip
    return out


def main() -> None:
    parser = arg_parser(__doc__, out="benchmarks/results/grouped_gemm_<device>.json; with --quick, only with --out",
                        quick="a tiny shape on CPU (Triton's interpreter)")  # fmt: skip
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time the grouped kernels' launch configurations")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dims = TINY if args.quick else SHAPE
    tokens = [64] if args.quick else args.tokens
    reps = 1 if args.quick else args.reps
    name = device_name()
    p = hardware(name)
    h, i = dims["hidden_size"], dims["moe_intermediate_size"]
    results = []
    for t in tokens:
        counts = routing_counts(t, dims)
        row = {"tokens": t, "routed_rows": sum(counts), "experts_with_rows": sum(c > 0 for c in counts)}
        projections = [("gate_up", 2 * i, h), ("down", h, i)]
        row["projections"] = [bench_projection(pn, counts, n, k, device, reps, p) for pn, n, k in projections]
        row["kernels"] = {pn: bench_kernels(counts, n, k, device, reps, p, args.sweep) for pn, n, k in projections}
        if cuda:
            keys = ("bf16_ms", "fp8_ms", "fp8_with_weight_quant_ms", *(("bf16_floor_ms", "fp8_floor_ms") if p else ()))
            keys += tuple(key for key in row["projections"][0] if key.startswith("fp8_") and key.endswith("_ms"))
            for key in dict.fromkeys(keys):
                row[key] = sum(pr[key] for pr in row["projections"])
            row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
            row["speedup_with_weight_quant"] = row["bf16_ms"] / row["fp8_with_weight_quant_ms"]
            print(f"{t:>6} tokens ({row['routed_rows']} routed rows): bf16 {row['bf16_ms']:.3f} ms, fp8 "
                  f"{row['fp8_ms']:.3f} ms ({row['speedup']:.2f}x; with weight quantization "
                  f"{row['speedup_with_weight_quant']:.2f}x)", flush=True)  # fmt: skip
            for pn, ks in row["kernels"].items():
                for kr in ks:
                    extra = {a: b for a, b in kr.items() if a not in ("kernel", "ms", "floor_ms")}
                    print(f"    {pn:8s} {kr['kernel']:42s} {kr.get('ms', 0):.3f} ms {json.dumps(extra)}", flush=True)
        results.append(row)
    result = {
        "benchmark": "MoE projection grouped GEMMs fwd+bwd: BF16 torch._grouped_mm vs blockwise FP8",
        **metadata(name),
        "shape": dims,
        "peaks": p,
        "results": results,
    }
    if args.quick and not args.out:
        print(json.dumps(result)[:2000])
        return
    print(f"wrote {write_json(results_path(args.out, 'grouped_gemm', name), result, indent=1)}")


if __name__ == "__main__":
    main()
