"""One mixture-of-experts layer's experts, forward + backward: BF16 (transformers' `grouped_mm` experts, one grouped
GEMM per projection) against our FP8 experts (`FP8Experts`), at Qwen3-30B-A3B's expert shape (hidden 2048,
intermediate 768, 128 experts, top-8), for several routed-token counts.

    python -m benchmarks.bench_experts                      # GPU host: 1k, 4k, 8k tokens (8k-64k routed)
    python -m benchmarks.bench_experts --quick              # CPU smoke run at a tiny shape
    python -m benchmarks.bench_experts --loop               # also the per-expert loop the grouped kernels replace

Each row also records the host time per call against the GPU kernels' (profiled). On the GPU the FP8 experts run on
the grouped kernels (`trl_fp8.kernels.grouped_gemm`, a fixed number of launches per projection); `--loop` adds the
per-expert loop (host-bound: a launch per expert and GEMM). The floor of the six grouped GEMMs at 8192 tokens is in
that module's docstring (1.23 ms on an H100 SXM).
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch

from benchmarks.common import (
    arg_parser,
    device_kernel_events,
    device_name,
    kernel_breakdown,
    metadata,
    results_path,
    write_json,
)

QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
TINY = dict(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)


def make_experts(dims: dict, device: str, implementation: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(**dims, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            vocab_size=128)  # fmt: skip
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():  # a trained model's scale, not the init's zeros
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    return experts


def routing(tokens: int, dims: dict, device: str, seed: int = 0):
    """Top-k of random router logits: uneven counts per expert, as a router gives."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, dims["num_experts"], generator=g)
    weights, index = torch.topk(torch.softmax(logits, dim=-1), dims["num_experts_per_tok"], dim=-1)
    return index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device=device, dtype=torch.bfloat16)


@contextlib.contextmanager
def host_syncing_counts():
    """The experts' rows per expert counted by `torch.bincount` (the host waits for the GPU), not `expert_counts`."""
    from trl_fp8.nn import experts

    counts = experts.expert_counts
    experts.expert_counts = lambda ids, num_experts: torch.bincount(ids, minlength=num_experts)
    try:
        yield
    finally:
        experts.expert_counts = counts


def time_ms(fn, cuda: bool, reps: int) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def profiled(fn, cuda: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
    kernels = [e for e in device_kernel_events(prof) if e.self_device_time_total > 0]
    return {"host_issue_ms": host * 1e3, "gpu_kernels_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
            "launches": sum(e.count for e in kernels), **kernel_breakdown(prof, top=12)}  # fmt: skip


def main() -> None:
    parser = arg_parser(
        __doc__, out="benchmarks/results/experts_<device>.json", quick="a tiny shape, for a CPU smoke run"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--loop", action="store_true", help="also time the FP8 per-expert loop")
    args = parser.parse_args()
    from trl_fp8 import FP8LinearConfig
    from trl_fp8.nn.experts import FP8Experts, grouped_gemm_kernel

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dims = TINY if args.quick else QWEN3_30B_A3B
    tokens = [64] if args.quick else args.tokens
    reps = 1 if args.quick else args.reps
    bf16 = make_experts(dims, device, "grouped_mm" if cuda else "eager")
    # Gradients accumulate over the repetitions, as over a step's micro-batches. "fp8" adds them into `.grad` in its
    # WGrad kernel, as FP8GRPOTrainer does in one process; "fp8_autograd_add" returns them for autograd to add.
    # "fp8_no_cache_in_training": as the trainer runs where memory is tight (cache_with_grad=False), each forward
    # quantizes the weights and DGrad re-quantizes them, where "fp8" takes both from the cache (DGrad transposing the
    # cached blocks).
    # "fp8_host_sync": "fp8" counting each expert's rows with `torch.bincount`, as trl-fp8 did up to 2026-11-28, which
    # makes the host wait for the GPU at every layer call (it copies the ids' min and max to the host).
    configs = {
        "fp8": FP8LinearConfig(fuse_wgrad_accumulation=True),
        "fp8_autograd_add": FP8LinearConfig(),
        "fp8_no_cache_in_training": FP8LinearConfig(fuse_wgrad_accumulation=True, cache_with_grad=False),
        "fp8_host_sync": FP8LinearConfig(fuse_wgrad_accumulation=True),
    }
    variants = [("bf16", bf16)] + [
        (name, FP8Experts.convert_(copy.deepcopy(bf16), cfg)) for name, cfg in configs.items()
    ]
    fp8 = dict(variants)["fp8"]
    if args.loop:
        fp8_loop = FP8Experts.convert_(copy.deepcopy(bf16), FP8LinearConfig())
        fp8_loop._grouped_kernels = False
        variants.append(("fp8_loop", fp8_loop))
    rows = []
    for t in tokens:
        index, weights = routing(t, dims, device)
        x = torch.randn(t, dims["hidden_size"], device=device, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        outs = {}
        row = {"tokens": t, "routed_tokens": t * dims["num_experts_per_tok"],
               "experts_with_tokens": int(index.unique().numel()),
               # which kernel ran FProp and DGrad ("auto": DeepGEMM where vLLM's bundled copy runs, else Triton)
               "fp8_fprop_dgrad_kernel": grouped_gemm_kernel(fp8.fp8_config.experts_gemm, x) if cuda else "emulation"}  # fmt: skip
        for name, module in variants:

            def step(module=module, x=x, index=index, weights=weights, dy=dy, name=name):
                xg = x.detach().requires_grad_()
                with host_syncing_counts() if name == "fp8_host_sync" else contextlib.nullcontext():
                    out = module(xg, index, weights)
                out.backward(dy)
                return out

            outs[name] = step().detach().float()
            row[f"{name}_ms"] = time_ms(step, cuda, reps)
            row[f"{name}_profile"] = profiled(step, cuda)
        row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        row["in_place_add_speedup"] = row["fp8_autograd_add_ms"] / row["fp8_ms"]
        row["no_cache_speedup"] = row["bf16_ms"] / row["fp8_no_cache_in_training_ms"]
        row["host_sync_speedup"] = row["bf16_ms"] / row["fp8_host_sync_ms"]
        row["fp8_rel_err_vs_bf16"] = float((outs["fp8"] - outs["bf16"]).norm() / outs["bf16"].norm())
        if args.loop:
            row["loop_speedup"] = row["bf16_ms"] / row["fp8_loop_ms"]
            row["fp8_rel_diff_vs_loop"] = float((outs["fp8"] - outs["fp8_loop"]).norm() / outs["fp8_loop"].norm())
        rows.append(row)
        print(f"{t:>6} tokens ({row['routed_tokens']} routed): bf16 {row['bf16_ms']:.2f} ms, fp8 {row['fp8_ms']:.2f} ms "
              f"({row['speedup']:.2f}x, FProp/DGrad on {row['fp8_fprop_dgrad_kernel']}), fp8 vs bf16 output rel err "
              f"{row['fp8_rel_err_vs_bf16']:.3f}")  # fmt: skip
        print(f"{'':>6} gradients added by autograd {row['fp8_autograd_add_ms']:.2f} ms: the in-place add "
              f"{row['in_place_add_speedup']:.2f}x; no weight cache in training "
              f"{row['fp8_no_cache_in_training_ms']:.2f} ms ({row['no_cache_speedup']:.2f}x BF16); counted with "
              f"torch.bincount (a host sync) {row['fp8_host_sync_ms']:.2f} ms ({row['host_sync_speedup']:.2f}x BF16)")  # fmt: skip
        if args.loop:
            print(f"{'':>6} per-expert loop {row['fp8_loop_ms']:.2f} ms ({row['loop_speedup']:.2f}x), grouped vs loop "
                  f"output rel diff {row['fp8_rel_diff_vs_loop']:.1e}")  # fmt: skip
    name = device_name()
    result = {"benchmark": "MoE experts fwd+bwd: BF16 grouped_mm vs FP8Experts", **metadata(name), "shape": dims,
              "results": rows}  # fmt: skip
    print(f"wrote {write_json(results_path(args.out, 'experts', name), result, indent=1)}")


if __name__ == "__main__":
    main()
