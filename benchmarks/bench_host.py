"""Host cost of each piece of an FP8 linear layer: microseconds of CPU time to issue one call, at sizes so small
that the GPU finishes every kernel before the host issues the next (the loop is host-bound by construction).

A decoder layer's FP8 fwd+bwd issues quantizer launches, cuBLAS blockwise GEMMs and Python glue where BF16 issues
three `mm`s; at 1.7B-8B training sizes this host time is what the GPU waits for (`bench_linear --profile`,
`bench_train_step`). This splits it, so each fix can be weighed before it is written:

    python -m benchmarks.bench_host                  # on the GPU host
    python -m benchmarks.bench_host --quick          # CPU: only the rows that run without CUDA
    python -m benchmarks.bench_host --profile DIR    # and where the layers' host time goes, op by op

`--profile` runs the layer rows (`PROFILED`) again under the torch profiler: each op's calls and self CPU time per
layer call land in the row (`host_ops`) and the profiler's table in DIR, so the gap between an FP8 layer's host time
and the sum of its kernels' launches is named op by op.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import arg_parser, device_name, metadata, results_path, write_json
from trl_fp8 import FP8Linear, FP8LinearConfig
from trl_fp8.nn.linear import forget_quantized_input
from trl_fp8.nn.sibling_gemms import FP8SiblingGroup


def host_us(fn, calls: int, cuda: bool) -> float:
    """Microseconds per call of `fn()` issued back to back (one sync at the end)."""
    for _ in range(min(50, calls)):
        fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


PROFILED = ("nn.Linear fwd+bwd", "FP8Linear fwd+bwd (cached W)", "3 x FP8Linear as one sibling GEMM fwd+bwd")


def host_ops(fn, calls: int, cuda: bool, table_path=None, top: int = 25) -> dict:
    """`fn` under the torch profiler: `{"ops_per_call", "self_cpu_us_per_call", "ops": [{name, calls_per_call,
    self_cpu_us_per_call}, ...]}`, the `top` ops by self CPU time (ops as the profiler names them: ATen ops,
    `autograd::engine` nodes, Triton and cuBLAS launches); `table_path`: the profiler's own table there."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(min(20, calls)):
        fn()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    if table_path is not None:
        table_path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
    return {
        "ops_per_call": sum(e.count for e in events) / calls,
        "self_cpu_us_per_call": sum(e.self_cpu_time_total for e in events) / calls,
        "ops": [{"name": e.key, "calls_per_call": e.count / calls, "self_cpu_us_per_call": e.self_cpu_time_total / calls}
                for e in events[:top]],
    }  # fmt: skip


def cases(m: int, k: int, n: int, device: str) -> dict:
    """name -> a callable issuing that piece once."""
    cuda = device == "cuda"
    bf16 = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=bf16)
    w = torch.randn(n, k, device=device, dtype=bf16)
    dy = torch.randn(m, n, device=device, dtype=bf16)
    out = {
        "torch.empty": lambda: torch.empty(m, k, device=device, dtype=bf16),
        "bf16 mm": lambda: torch.mm(x, w.t()),
        "autograd.Function identity fwd+bwd": lambda: _Identity.apply(x.detach().requires_grad_()).backward(x),
    }

    def layer_step(layer, inputs=None):
        def step():
            xg = x.detach().requires_grad_()
            forget_quantized_input()
            layer(xg).backward(dy)

        return step

    lin = nn.Linear(k, n, bias=False, device=device, dtype=bf16)
    out["nn.Linear fwd+bwd"] = layer_step(lin)
    fp8 = FP8Linear.convert_(nn.Linear(k, n, bias=False, device=device, dtype=bf16), FP8LinearConfig())
    out["FP8Linear fwd+bwd (cached W)"] = layer_step(fp8)
    nocache = FP8Linear.convert_(
        nn.Linear(k, n, bias=False, device=device, dtype=bf16), FP8LinearConfig(cache_quantized_weight=False)
    )
    out["FP8Linear fwd+bwd (W quantized per call)"] = layer_step(nocache)

    q, kk, v = (nn.Linear(k, n, bias=False, device=device, dtype=bf16) for _ in range(3))
    bq, bk, bv = (nn.Linear(k, n, bias=False, device=device, dtype=bf16) for _ in range(3))

    def three(layers):
        def step():
            xg = x.detach().requires_grad_()
            forget_quantized_input()
            sum(layer(xg).sum() for layer in layers).backward()

        return step

    out["3 x nn.Linear on one input fwd+bwd"] = three((bq, bk, bv))
    members = [FP8Linear.convert_(layer, FP8LinearConfig()) for layer in (q, kk, v)]
    out["3 x FP8Linear on one input fwd+bwd"] = three(members)
    siblings = [FP8Linear.convert_(nn.Linear(k, n, bias=False, device=device, dtype=bf16), FP8LinearConfig())
                for _ in range(3)]  # fmt: skip
    FP8SiblingGroup(siblings)
    out["3 x FP8Linear as one sibling GEMM fwd+bwd"] = three(siblings)
    if cuda:
        import triton
        import triton.language as tl

        from trl_fp8.ops import scaled_mm

        @triton.jit
        def _noop(ptr, BLOCK: tl.constexpr):
            tl.store(ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))

        flag = torch.empty(128, device=device)
        act = scaled_mm.quantize_act(x)
        w_q, w_s = scaled_mm.quantize_weight(w)
        # The same layers compiled (the FP8 ops as custom ops, one compiled backward node): what compiling saves
        out["nn.Linear fwd+bwd, torch.compile"] = layer_step(torch.compile(lin))
        out["FP8Linear fwd+bwd (cached W), torch.compile"] = layer_step(torch.compile(fp8))
        out.update({
            "triton launch, no-op kernel": lambda: _noop[(1,)](flag, BLOCK=128),
            "quantize_act rows (Triton)": lambda: scaled_mm.quantize_act(x),
            "quantize_act rows+cols (Triton)": lambda: scaled_mm.quantize_act(x, cols=True),
            "quantize_weight col-major (Triton)": lambda: scaled_mm.quantize_weight(w, col_major=True),
            "F.scaled_mm blockwise (ops.scaled_mm.gemm)": lambda: scaled_mm.gemm(act.q, act.scale_inv, w_q, w_s, True, bf16),
        })  # fmt: skip
        from trl_fp8.ops import deep_gemm

        if deep_gemm.available() is None:  # vLLM's DeepGEMM, where installed
            out["DeepGEMM fp8_gemm_nt (ops.deep_gemm.gemm)"] = lambda: deep_gemm.gemm(act.q, act.scale_inv, w_q, w_s,
                                                                                     True, bf16)  # fmt: skip
    return out


def main() -> None:
    parser = arg_parser(__doc__, out="benchmarks/results/host_<device>.json", quick="few calls, for a CPU smoke run")
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", type=Path, help="also profile the layer rows (PROFILED); tables into this folder")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    calls = 20 if args.quick else args.calls
    name = device_name()
    rows = []
    print(f"host microseconds per call, m={args.m} k={args.k} n={args.n}, {name}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    for label, fn in cases(args.m, args.k, args.n, device).items():
        us = host_us(fn, calls, cuda)
        rows.append({"case": label, "host_us": us})
        print(f"{label:<48} {us:9.1f}")
        if args.profile and label in PROFILED:
            table = args.profile / f"{label.split(' fwd')[0].replace(' ', '_')}.txt"
            rows[-1]["host_ops"] = ops = host_ops(fn, min(calls, 200), cuda, table)
            top = ", ".join(f"{o['name']} {o['self_cpu_us_per_call']:.0f}" for o in ops["ops"][:5])
            print(f"{'':<4}profiled: {ops['ops_per_call']:.0f} ops a call, {ops['self_cpu_us_per_call']:.0f} us self CPU "
                  f"(under the profiler); top: {top}")  # fmt: skip
    result = {
        "benchmark": "host cost per call of an FP8 linear layer's pieces (host-bound loop)",
        **metadata(name),
        "settings": {"m": args.m, "k": args.k, "n": args.n, "calls": calls},
        "results": rows,
    }
    print(f"wrote {write_json(results_path(args.out, 'host', name), result, indent=1)}")


if __name__ == "__main__":
    main()
