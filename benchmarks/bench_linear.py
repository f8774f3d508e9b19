"""Forward+backward time of one linear layer at Qwen3-8B shapes: BF16 vs FP8 recipes, side by side in one run.

    python -m benchmarks.bench_linear            # on an SM90 GPU; writes benchmarks/results/linear_<device>.json
    python -m benchmarks.bench_linear --shape 1.7b   # Qwen3-1.7B's layers: results/linear_1.7b_<device>.json
    python -m benchmarks.bench_linear --quick    # CPU smoke run of the same code (emulated FP8, tiny shapes)

Variants: BF16 `nn.Linear`; trl_fp8 blockwise (`FP8Linear`, weight re-quantized every call as after each optimizer
step, and with the weight cache hit, as for further micro-batches and log-prob passes); torchao's blockwise
prototype (`Float8BlockwiseLinear`); for q/k/v as three layers, trl_fp8 running them as one GEMM per pass
(`FP8Tuning(fuse_sibling_gemms=True)`); torchao tensorwise `Float8Linear` (eager and `torch.compile`). On the GPU also
trl_fp8 with FProp/DGrad on DeepGEMM (`backend="deepgemm"`) and trl_fp8 under `torch.compile`. Also the raw
GEMMs (BF16 mm vs one blockwise FP8 scaled_mm) and where trl_fp8's time goes (quantization passes vs GEMMs). On an
H100 or H200 the BF16 and trl_fp8 rows also get their floor (`benchmarks/floors.py`) and the fraction of it reached.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.bench_rollout import hardware
from benchmarks.common import arg_parser, device_kernel_events, device_name, metadata, results_path, write_json
from benchmarks.floors import linear_floor_s
from trl_fp8 import FP8Linear, FP8LinearConfig
from trl_fp8.nn.linear import forget_quantized_input
from trl_fp8.nn.sibling_gemms import FP8SiblingGroup

QWEN3_8B = [
    (4096, 6144, "qkv_proj"),
    (4096, (4096, 1024, 1024), "q,k,v (3 layers)"),  # transformers' Qwen3: three layers reading one input
    (4096, 4096, "o_proj"),
    (4096, 24576, "gate_up_proj"),
    (12288, 4096, "down_proj"),
]
QWEN3_1_7B = [  # hidden 2048, 16 query and 8 KV heads of 128, intermediate 6144
    (2048, 4096, "qkv_proj"),
    (2048, (2048, 1024, 1024), "q,k,v (3 layers)"),
    (2048, 2048, "o_proj"),
    (2048, 12288, "gate_up_proj"),
    (6144, 2048, "down_proj"),
]
SHAPES = {"8b": QWEN3_8B, "1.7b": QWEN3_1_7B}


def bench(fn, reps: int, cuda: bool, grad_to_none=()) -> float:
    """Median milliseconds of fn()."""
    if cuda:
        from triton.testing import do_bench

        for _ in range(3):  # compile / autotune / cuBLAS heuristics outside the timed region and do_bench's estimate
            fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=reps, grad_to_none=list(grad_to_none), return_mode="median")
    for _ in range(2):
        fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


class SharedInputLinears(nn.Module):
    """Several linear layers reading the same input, outputs concatenated (q/k/v as transformers runs them)."""

    def __init__(self, k, ns, **kw):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(k, n, bias=False, **kw) for n in ns)

    def forward(self, x):
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


def make_variants(k, n, device, dtype, cuda):
    def bf16():
        if isinstance(n, tuple):
            return SharedInputLinears(k, n, device=device, dtype=dtype)
        return nn.Linear(k, n, bias=False, device=device, dtype=dtype)

    def each_layer(mod, convert):  # convert(layer) -> layer, applied to the layer or to each shared-input layer
        if isinstance(mod, nn.Linear):
            return convert(mod)
        mod.layers = nn.ModuleList(convert(layer) for layer in mod.layers)
        return mod

    def ours(cache, backend="auto"):
        config = FP8LinearConfig(cache_quantized_weight=cache, backend=backend)
        return each_layer(bf16(), lambda layer: FP8Linear.convert_(layer, config))

    variants = {"bf16": bf16(), "trl_fp8 blockwise": ours(False), "trl_fp8 blockwise (cached W)": ours(True)}
    if isinstance(n, tuple):  # the layers reading one input as one GEMM per pass (fuse_sibling_gemms)
        fused = ours(True)
        FP8SiblingGroup(list(fused.layers))
        variants["trl_fp8 blockwise (cached W, one GEMM)"] = fused
    if cuda:
        from trl_fp8.ops import deep_gemm

        if deep_gemm.available() is None:  # FProp and DGrad on DeepGEMM, the opt-in backend
            variants["trl_fp8 deepgemm (cached W)"] = ours(True, "deepgemm")
        # Compiled: no Python between kernels, the weight quantized inside the graph at every call (no cache there)
        variants["trl_fp8 blockwise (compiled)"] = torch.compile(ours(False))
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        variants["torchao blockwise prototype"] = each_layer(bf16(), Float8BlockwiseLinear.from_float)
        tw = nn.Sequential(bf16())
        convert_to_float8_training(tw, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        variants["torchao tensorwise"] = tw
        tw_c = nn.Sequential(bf16())
        convert_to_float8_training(tw_c, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        variants["torchao tensorwise (compiled)"] = torch.compile(tw_c)
    return variants


# How many times each variant quantizes the weight per forward + backward (`benchmarks.floors.linear_floor_s`): the
# forward's copy unless cached, DGrad's re-quantization unless a sibling group multiplies by the cached copy. torchao's
# variants quantize by other recipes and get no floor.
WEIGHT_QUANTIZATIONS = {"trl_fp8 blockwise": 2, "trl_fp8 blockwise (cached W)": 1,
                        "trl_fp8 blockwise (cached W, one GEMM)": 0, "trl_fp8 deepgemm (cached W)": 1,
                        "trl_fp8 blockwise (compiled)": 2}  # fmt: skip


def add_floor(row: dict, variant: str, m: int, k: int, n: int, hw: dict | None) -> None:
    """The row's floor in ms (its three GEMMs and, in FP8, its quantization passes at the GPU's data-sheet peaks) and
    the fraction of it the layer reaches, for BF16 and trl-fp8's variants on a GPU whose peaks are known."""
    if hw is None or (variant != "bf16" and variant not in WEIGHT_QUANTIZATIONS):
        return
    fp8 = variant != "bf16"
    row["floor_ms"] = 1e3 * linear_floor_s(m, k, n, fp8, hw, WEIGHT_QUANTIZATIONS.get(variant, 0))
    row["of_floor"] = row["floor_ms"] / row["ms"]


def breakdown(m, k, n, device, dtype, reps, cuda):
    """Milliseconds of each step of trl_fp8's blockwise fwd+bwd, run in isolation."""
    from trl_fp8.ops import select_ops

    ops = select_ops(FP8LinearConfig(), torch.device(device))
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    xa = ops.quantize_act(x, rows=True, cols=True)
    wq, ws = ops.quantize_weight(w)
    wdq, wds = ops.quantize_weight(w, col_major=True)
    ga = ops.quantize_act(dy, rows=True, cols=True)
    steps = {
        "quant x (both layouts)": lambda: ops.quantize_act(x, rows=True, cols=True),
        "quant W (128x128)": lambda: ops.quantize_weight(w),
        "quant W (dgrad layout)": lambda: ops.quantize_weight(w, col_major=True),
        "quant dy (both layouts)": lambda: ops.quantize_act(dy, rows=True, cols=True),
        "gemm fprop": lambda: ops.gemm(xa.q, xa.scale_inv, wq, ws, True, dtype),
        "gemm dgrad": lambda: ops.gemm(ga.q, ga.scale_inv, wdq.t(), wds.t(), True, dtype),
        "gemm wgrad": lambda: ops.gemm(ga.qt, ga.scale_inv_t, xa.qt, xa.scale_inv_t, False, dtype),
        "bf16 mm (one GEMM)": lambda: x @ w.t(),
    }
    return {name: bench(fn, reps, cuda) for name, fn in steps.items()}


def profile_step(mod, x, dy, cuda, out_dir, label, name, iters=20):
    """Wall time per fwd+bwd against the host time spent issuing it and the GPU kernel time it queues. Kernel time
    well under wall time with host time near wall time means the layer is host-bound (launch and Python overhead)."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        forget_quantized_input()
        mod(x).backward(dy)

    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        host = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in device_kernel_events(prof))
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunch")))
    out_dir.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    safe = f"{label}_{name}".replace(" ", "_").replace("(", "").replace(")", "")
    (out_dir / f"profile_{safe}.txt").write_text(events.table(sort_by=sort, row_limit=30))
    row = {
        "wall_ms": wall / iters * 1e3,
        "host_issue_ms": host / iters * 1e3,
        "gpu_kernels_ms": kernel_us / iters / 1e3,
        "launches": launches / iters,
    }
    print(f"profile {label:<13} {name:<30} wall {row['wall_ms']:.3f} ms, host {row['host_issue_ms']:.3f} ms, "
          f"kernels {row['gpu_kernels_ms']:.3f} ms, {row['launches']:.0f} launches")  # fmt: skip
    return row


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/linear_<device>.json; with --quick, only with --out",
                        quick="tiny shapes, for a CPU smoke run")  # fmt: skip
    parser.add_argument("--shape", choices=list(SHAPES), default="8b", help="the Qwen3 model whose layers are timed")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=200, help="milliseconds of timed repeats per case (GPU)")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also profile bf16 and trl_fp8 (cached W) per shape: host time vs GPU kernel time, op tables to DIR",
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch._dynamo.config.recompile_limit = 64  # every shape's compiled variants are new modules: one compile each
    dtype = torch.bfloat16
    shapes = (
        [(256, 384, "tiny_a"), (512, 256, "tiny_b"), (256, (128, 256), "tiny_ab")]
        if args.quick
        else SHAPES[args.shape]
    )
    m = 256 if args.quick else args.tokens
    device_label = device_name()
    hw = hardware(device_label)  # the data-sheet peaks the floors take (None: no floors on this device)

    rows, breakdowns, profiles = [], {}, {}
    for k, n, label in shapes:
        variants = make_variants(k, n, device, dtype, cuda)
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, sum(n) if isinstance(n, tuple) else n, device=device, dtype=dtype)
        times = {}
        for name, mod in variants.items():
            params = list(mod.parameters())

            def step(mod=mod, x=x, dy=dy):
                forget_quantized_input()  # the same x every call: quantize it every call, as a new activation would be
                mod(x).backward(dy)

            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            row = {"shape": label, "K": k, "N": n, "M": m, "variant": name}
            try:
                times[name] = row["ms"] = bench(step, args.reps, cuda, grad_to_none=(x, *params))
            except Exception as e:  # one variant failing (a compiler error, say) must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"{label} {name}: FAILED {row['error']}", flush=True)
                rows.append(row)
                continue
            row["peak_extra_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
            row["speedup_vs_bf16"] = times["bf16"] / row["ms"]
            add_floor(row, name, m, k, sum(n) if isinstance(n, tuple) else n, hw)
            rows.append(row)
        if not isinstance(n, tuple):  # the shared-input group is made of the layers measured on their own
            breakdowns[label] = breakdown(m, k, n, device, dtype, args.reps, cuda)
        if args.profile:
            for name in ("bf16", "trl_fp8 blockwise (cached W)"):
                mod = variants[name]
                profiles.setdefault(label, {})[name] = profile_step(mod, x, dy, cuda, Path(args.profile), label, name)
        del variants

    result = {
        "benchmark": "linear fwd+bwd",
        **metadata(device_label),
        "dtype": str(dtype),
        "shape": "tiny" if args.quick else args.shape,
        "tokens": m,
        "results": rows,
        "trl_fp8_breakdown_ms": breakdowns,
    }
    if profiles:
        result["profile_per_iteration"] = profiles
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"\nLinear fwd+bwd, M={m} tokens, {device_label}: ms (speedup vs bf16)")
    print(f"{'shape':<14}" + "".join(f"{n[:28]:>31}" for n in names))
    for _, _, label in shapes:
        cells = {r["variant"]: r for r in rows if r["shape"] == label}
        print(f"{label:<14}" + "".join(
            f"{cells[v]['ms']:>21.3f} ({cells[v]['speedup_vs_bf16']:.2f}x)" if "ms" in cells.get(v, {})
            else f"{'failed' if v in cells else '-':>31}"
            for v in names
        ))  # fmt: skip
    if any("of_floor" in r for r in rows):
        print("\nAgainst the floor (the GEMMs and FP8 quantization passes at the data-sheet peaks):")
        for r in rows:
            if "of_floor" in r:
                print(f"{r['shape']:<14} {r['variant']:<40} {r['ms']:8.3f} ms, floor {r['floor_ms']:.3f} ms: "
                      f"{r['of_floor']:.0%}")  # fmt: skip
    print("\ntrl_fp8 blockwise breakdown (ms):")
    steps = list(next(iter(breakdowns.values())))
    print(f"{'shape':<14}" + "".join(f"{s[:20]:>21}" for s in steps))
    for label, b in breakdowns.items():
        print(f"{label:<14}" + "".join(f"{b[s]:>21.3f}" for s in steps))
    for label, b in breakdowns.items():
        quant = sum(v for s, v in b.items() if s.startswith("quant"))
        gemm = sum(v for s, v in b.items() if s.startswith("gemm"))
        total = next(r["ms"] for r in rows if r["shape"] == label and r["variant"] == "trl_fp8 blockwise")
        b["unaccounted (total - quant - gemm)"] = total - quant - gemm
        print(f"{label}: quantization {quant:.3f} ms, FP8 GEMMs {gemm:.3f} ms "
              f"(3 x bf16 mm {3 * b['bf16 mm (one GEMM)']:.3f} ms); fwd+bwd {total:.3f} ms, "
              f"unaccounted {total - quant - gemm:+.3f} ms (launch/autograd overhead, or overlap if negative)")  # fmt: skip

    # (written last, so the JSON holds the unaccounted-time column computed above)
    if not args.quick or args.out:
        stem = "linear" if args.shape == "8b" else f"linear_{args.shape}"
        print(f"wrote {write_json(results_path(args.out, stem, device_label), result)}")


if __name__ == "__main__":
    main()
