"""The training phase of a GRPO step alone, without vLLM: micro-batches of forward + backward (gradient checkpointing,
as `bench_grpo` trains, unless a flow says otherwise) and one optimizer step, BF16 against the FP8 flows. Minutes instead of `bench_grpo`'s
engine start-ups, for comparing training-side options (the opt-in fusions, Liger's kernels) side by side.

    python -m benchmarks.bench_train_step --shape 1.7b                 # the whole 1.7B shape
    python -m benchmarks.bench_train_step --shape 8b --layers 12       # 12 decoder layers of the 8B shape
    python -m benchmarks.bench_train_step --shape tiny --quick         # CPU smoke run

On an H100 or H200 each row also gets its floor (`benchmarks/floors.py`: the GEMMs, attention and FP8 quantization
passes at the data-sheet peaks) and the fraction of it the step reaches, and each FP8 flow its ratio against its
BF16 twin (the BF16 flow with the same Liger kernels, checkpointing and compilation).

The loss is the LM cross-entropy over every token (a BF16 `lm_head`, the same in every flow); the optimizer is SGD
with a zero learning rate, so weights keep their values but FP8 flows requantize them once per step, as in training.

Each flow runs in a process of its own: Liger's `apply_liger_kernel_to_*` replaces the model type's RoPE function and
its RMSNorm and MLP classes module-wide even when given one model, so a flow built after a Liger flow in the same
process would run Liger's kernels too; compiled flows would share Dynamo's caches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_rollout import SHAPES, hardware
from benchmarks.common import (
    arg_parser,
    device_kernel_events,
    device_name,
    kernel_breakdown,
    metadata,
    results_path,
    run_child,
    write_json,
)
from benchmarks.floors import train_step_floor_s

FLOWS = {  # flow: FP8 conversion options (None: BF16), Liger's layer kernels, checkpoint every n-th layer (0: none)
    # (a "_compiled" flow also compiles each decoder layer: torch.compile, the FP8 ops as custom ops; with Liger's
    # kernels applied first where it says "liger")
    "bf16": (None, False, 1),
    "fp8": ({}, False, 1),
    "fp8_fused": ({"fuse_sibling_gemms": True, "fuse_swiglu": True}, False, 1),
    "fp8_nocache": ({"cache_quantized_weight": False}, False, 1),  # weights quantized at every forward: less memory
    "bf16_liger": (None, True, 1),
    "fp8_liger": ({}, True, 1),
    "fp8_siblings_liger": ({"fuse_sibling_gemms": True}, True, 1),  # Liger's SwiGLU in place of ours
    # Memory into speed: transformers' `gradient_checkpointing_kwargs={"every_n_layers": n}` (TrainingArguments)
    "bf16_compiled": (None, False, 1),
    "fp8_compiled": ({}, False, 1),
    # Liger's kernels inside the compiled layers (Dynamo traces their Triton kernels) against Inductor's own fusions
    "bf16_compiled_liger": (None, True, 1),
    "fp8_compiled_liger": ({}, True, 1),
    # FProp and DGrad on DeepGEMM (`FP8LinearConfig(backend="deepgemm")`, vLLM's bundled copy), WGrad on cuBLAS
    "fp8_deepgemm": ({"backend": "deepgemm"}, False, 1),
    "fp8_deepgemm_liger": ({"backend": "deepgemm"}, True, 1),
    "fp8_deepgemm_compiled": ({"backend": "deepgemm"}, False, 1),
    "bf16_ckpt2": (None, False, 2),
    "fp8_ckpt2": ({}, False, 2),
    "bf16_nockpt": (None, False, 0),
    "fp8_nockpt": ({}, False, 0),
    "bf16_liger_ckpt2": (None, True, 2),
    "fp8_liger_ckpt2": ({}, True, 2),
    "bf16_liger_nockpt": (None, True, 0),
    "fp8_liger_nockpt": ({}, True, 0),
}


def build(shape: str, layers: int | None, flow: str, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_fp8 import FP8LinearConfig, convert_to_fp8

    options, liger, every_n = FLOWS[flow]
    dims = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    config = Qwen3Config(**dims, head_dim=128, tie_word_embeddings=False, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    if options is not None:
        convert_to_fp8(model, config=FP8LinearConfig(**options))
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False)
    if every_n == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif every_n > 1:  # checkpoint every n-th decoder layer, the others keep their activations (transformers >= 5.17;
        # later versions name the method activation_checkpointing_enable, the older name still works there)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False}, every_n_layers=every_n)
    if "_compiled" in flow:
        for layer in model.model.layers:  # regional compilation: one graph per decoder layer, compiled once
            layer.compile()
    model.config.use_cache = False
    model.train()
    return model


def train_step(model, optimizer, batches) -> float:
    """One optimizer step over `batches`; returns the step's mean loss (a host sync, after the last backward)."""
    total = 0.0
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss / len(batches)
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def profile_step(model, optimizer, batches, out_dir: Path, flow: str) -> dict:
    """One more step under the profiler: wall time, GPU kernel time by category and kernel launches (is the step
    host-bound?), the op table (self CPU time first) to `out_dir`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = batches[0].is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        train_step(model, optimizer, batches)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"train_step_{flow}.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total",
                                                                              row_limit=40))  # fmt: skip
    kernels = [e for e in device_kernel_events(prof) if e.self_device_time_total > 0]
    return {
        "wall_ms": wall * 1e3,  # profiled: the profiler's own overhead is in it
        "kernel_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "launches": sum(e.count for e in kernels),
        **(kernel_breakdown(prof, top=10) if cuda else {}),
    }


def run_flow(args, flow: str, device: str) -> dict:
    model = build(args.shape, args.layers, flow, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, model.config.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(device)
               for _ in range(args.micro_batches)]  # fmt: skip
    cuda = device == "cuda"
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = train_step(model, optimizer, batches)
        if cuda:
            torch.cuda.synchronize()
        if step == 0:
            first_loss = loss  # the same weights and batches in every flow (learning rate 0): losses comparable
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if args.profile:
        profiled = profile_step(model, optimizer, batches, Path(args.profile), flow)
    row = {
        "flow": flow,
        "fp8_options": FLOWS[flow][0],
        "liger": FLOWS[flow][1],
        "checkpoint_every_n_layers": FLOWS[flow][2],
        "loss": first_loss,
        "step_s": statistics.median(times),
        "per_step_s": times,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "pid": os.getpid(),  # the process it ran in: one per flow (see the module doc)
    }
    if args.profile:
        row["profile"] = profiled
    return row


def flow_row(args, flow: str, device: str) -> dict:
    """`run_flow`'s row, or the flow and why it could not run here (a result too: the other flows go on)."""
    try:
        return run_flow(args, flow, device)
    except Exception as error:  # noqa: BLE001
        return {"flow": flow, "error": f"{type(error).__name__}: {error}"[:500]}


def main() -> None:
    parser = arg_parser(__doc__, out="benchmarks/results/train_step_<shape>_<device>.json",
                        quick="tiny sizes, for a CPU smoke run")  # fmt: skip
    parser.add_argument("--shape", choices=list(SHAPES), default="1.7b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    parser.add_argument("--flows", nargs="+", default=list(FLOWS), choices=list(FLOWS))
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument(
        "--seq_len", type=int, default=1152, help="prompt + completion tokens (bench_grpo: 128 + 1024)"
    )
    parser.add_argument("--micro_batches", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile", default=None, metavar="DIR", help="profile one more step per flow, tables to DIR")
    parser.add_argument("--one_flow", choices=list(FLOWS), default=None, help=argparse.SUPPRESS)  # (a child's flow)
    args = parser.parse_args()
    if args.quick:
        args.micro_batch, args.seq_len, args.micro_batches, args.steps, args.warmup = 1, 128, 1, 1, 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = device_name()
    result = {
        "benchmark": "training phase alone: fwd+bwd (gradient checkpointing) + optimizer step",
        **metadata(name),
        "settings": {k: v for k, v in vars(args).items() if k not in ("flows", "out", "quick", "profile", "one_flow")},
        "results": [],
    }
    if args.one_flow:  # a child of the loop below: this flow's row on stdout
        print(json.dumps(flow_row(args, args.one_flow, device)), flush=True)
        return
    path = results_path(args.out, f"train_step_{args.shape}", name)
    hw = hardware(name)  # the data-sheet peaks the floors take (None: no floors on this device)
    for flow in args.flows:
        failure: dict = {}
        rows = run_child(__spec__.name, "--one_flow", flow, sys.argv[1:], failure=failure)
        row = rows[-1] if rows else {"flow": flow, "error": "; ".join(failure.get("errors", []))[-500:] or
                                     f"exit {failure.get('exit')}"}  # fmt: skip
        result["results"].append(row)
        add_floor(row, args, hw)
        add_twin_ratios(result["results"])
        write_json(path, result, indent=1)  # after every flow: a run cut short keeps the flows it finished
        print(json.dumps(row), flush=True)
    base = next((r for r in result["results"] if r["flow"] == "bf16" and "step_s" in r), None)
    print(f"\n{args.shape} x {args.layers or 'all'} layers, {args.micro_batches} x {args.micro_batch} x {args.seq_len}"
          f" tokens a step, {name}; vs bf16, and an FP8 flow's own ratio against its BF16 twin")  # fmt: skip
    for r in result["results"]:
        if "step_s" not in r:
            print(f"{r['flow']:<20} {r['error']}")
            continue
        speed = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        twin = f"{r['vs_bf16_twin']:.2f}x vs {r['bf16_twin']}" if "vs_bf16_twin" in r else ""
        peak = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else ""
        floor = f"{r['of_floor']:.0%} of {r['floor']['floor_s']:.3f} s" if "of_floor" in r else ""
        print(f"{r['flow']:<20} {r['step_s']:8.3f} s  {speed:>6}  {peak:>9}  {floor:>18}  {twin}")
    print(f"wrote {path}")


def add_floor(row: dict, args, hw: dict | None) -> None:
    """The row's floor (`benchmarks.floors.train_step_floor_s`: its GEMMs, attention and FP8 quantization at the
    GPU's data-sheet peaks) and its step's fraction of it, where the GPU's peaks are known."""
    if hw is None or "step_s" not in row or row["flow"] not in FLOWS:
        return
    options, _, every_n = FLOWS[row["flow"]]
    fp8_options = options or {}
    shape = SHAPES[args.shape]
    row["floor"] = train_step_floor_s(
        shape, args.layers or shape["num_hidden_layers"], args.micro_batch, args.seq_len, args.micro_batches,
        fp8=options is not None, hw=hw, checkpoint_every_n=every_n,
        weight_cache=fp8_options.get("cache_quantized_weight", True) is not False,
        dgrad_requantizes=not fp8_options.get("fuse_sibling_gemms", False),
    )  # fmt: skip
    row["of_floor"] = row["floor"]["floor_s"] / row["step_s"]


def bf16_twin(flow: str) -> str | None:
    """The BF16 flow that differs from FP8 flow `flow` only in precision: the same Liger kernels, checkpointing and
    compilation (an FP8-only option, such as the fused sibling GEMMs, has no BF16 counterpart and counts as FP8's)."""
    options, liger, every_n = FLOWS[flow]
    if options is None:
        return None
    compiled = "_compiled" in flow
    return next((f for f, (o, lig, n) in FLOWS.items()
                 if o is None and lig == liger and n == every_n and ("_compiled" in f) == compiled), None)  # fmt: skip


def add_twin_ratios(rows: list[dict]) -> None:
    """Each FP8 row's step-time ratio against its BF16 twin's row (`bf16_twin`), where both ran."""
    times = {r["flow"]: r["step_s"] for r in rows if "step_s" in r}
    for r in rows:
        twin = bf16_twin(r["flow"]) if r["flow"] in FLOWS else None
        if "step_s" in r and twin in times:
            r["bf16_twin"], r["vs_bf16_twin"] = twin, times[twin] / r["step_s"]


if __name__ == "__main__":
    main()
