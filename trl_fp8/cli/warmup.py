"""`trl-fp8 warmup`: compile the DeepGEMM kernels of a model's FP8 engine in parallel, before vLLM starts, and
build FlashInfer's XQA decode for its FP8 KV cache.

    trl-fp8 warmup ./Qwen3-8B-FP8            # before `trl vllm-serve`: the kernels that server will use
    trl-fp8 warmup --shapes 6144x4096 4096x4096

Worker processes each run vLLM's own GEMM over a share of vLLM's warm-up token counts into DeepGEMM's cache
(`trl_fp8.rollout.vllm.deepgemm_warmup`); vLLM's warm-up then finds each kernel on disk. With a model, XQA is built
for its attention heads into FlashInfer's cache and checked (`trl_fp8.rollout.vllm.attention`), as the engine of an
FP8 KV cache (`--attention-backend CUSTOM`) will run it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from trl_fp8.cli.argtypes import positive_int
from trl_fp8.rollout.vllm.deepgemm_warmup import BLOCK, engine_gemm_shapes, precompile_deepgemm
from trl_fp8.rollout.vllm.partitions import check_tensor_parallel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="a model folder (its config.json): a BF16 model or an FP8 checkpoint")
    parser.add_argument("--shapes", nargs="+", metavar="NxK", help="GEMM shapes instead of a model, e.g. 6144x4096")
    parser.add_argument("--max_tokens", type=positive_int, default=4096,
                        help="the engine's max_num_batched_tokens (TRL's colocated engine: 4096; vLLM's server "
                             "default: 8192 or more, see its log)")  # fmt: skip
    parser.add_argument("--tensor_parallel_size", type=positive_int, default=1,
                        help="the server's --tensor_parallel_size: each rank's partitions are compiled")  # fmt: skip
    parser.add_argument(
        "--workers", type=positive_int, default=None, help="processes (default: CPU cores, at most 16)"
    )
    parser.add_argument("--cache_dir", default=None, help="DeepGEMM's cache (default: DG_JIT_CACHE_DIR, else vLLM's)")
    parser.add_argument("--full", action="store_true", help="every token count, as VLLM_DEEP_GEMM_WARMUP=full runs")
    parser.add_argument("--force", action="store_true", help="run even where a completed run is recorded")


def parse_shape(text: str) -> tuple[int, int]:
    """`NxK` (e.g. `6144x4096`) as `(N, K)`, both positive multiples of 128."""
    try:
        n, k = (int(d) for d in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shapes {text!r}: write each GEMM shape as NxK, e.g. 6144x4096.") from None
    if n <= 0 or k <= 0 or n % BLOCK or k % BLOCK:
        raise ValueError(f"--shapes {text!r}: N and K must be positive multiples of {BLOCK} (block-FP8 weights).")
    return n, k


def model_shapes(path: str, tensor_parallel: int = 1) -> list[tuple[int, int]]:
    """GEMM shapes of the model whose config.json is in `path` (built on the meta device, no weights read), one
    rank's partitions of them in an engine of `tensor_parallel` ranks (refused, naming the sizes that work, where a
    partition would not hold whole 128x128 blocks)."""
    from transformers import AutoModelForCausalLM

    from trl_fp8.hub import load_model_config
    from trl_fp8.nn.conversion import plan_fp8_conversion

    config = load_model_config(path)  # raises ValueError naming the fix
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    report, _ = plan_fp8_conversion(model, warn=False)
    check_tensor_parallel(model, set(report.converted), tensor_parallel, option="--tensor_parallel_size")
    return engine_gemm_shapes(model, set(report.converted), tensor_parallel)


def run(args: argparse.Namespace) -> int:
    from trl_fp8.rollout.vllm.kernels import deepgemm_unavailable_reason, rollout_kernel

    if bool(args.model) == bool(args.shapes):
        print("error: give a model folder or --shapes NxK ..., not both.", file=sys.stderr)
        return 2
    if why_not := deepgemm_unavailable_reason():
        print(f"error: DeepGEMM cannot run here ({why_not}). Run trl-fp8 warmup on the machine that will run the "
              "FP8 engine: an H100/H200 with vLLM and nvcc.", file=sys.stderr)  # fmt: skip
        return 2
    try:
        shapes = (model_shapes(args.model, args.tensor_parallel_size) if args.model
                  else [parse_shape(s) for s in args.shapes])  # fmt: skip
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(rollout_kernel("deepgemm", jit_cache_dir=args.cache_dir).env)
    result = precompile_deepgemm(shapes, args.max_tokens, workers=args.workers, full=args.full, force=args.force)
    if result.skipped:
        print(f"Nothing to do: {result.skipped} (--force runs it again).")
    else:
        print(
            f"{len(shapes)} GEMM shapes, {result.token_counts} token counts, {result.workers} workers: "
            f"{result.kernels_after} kernels in {os.environ['DG_JIT_CACHE_DIR']} "
            f"({result.kernels_after - result.kernels_before} new) in {result.seconds:.0f} s"
        )
    xqa = None
    if args.model:
        xqa = build_xqa(args.model, args.tensor_parallel_size)
        print(f"XQA decode for an FP8 KV cache: {'built and checked' if xqa is None else f'not built ({xqa})'}")
    print(json.dumps({**result.__dict__, "cache_dir": os.environ["DG_JIT_CACHE_DIR"], "xqa_unavailable": xqa}))
    return 1 if result.failures else 0


def build_xqa(path: str, tensor_parallel: int = 1) -> str | None:
    """Build and check XQA for the attention heads of the model in `path` (one rank's share of them under tensor
    parallelism; XQA's build depends on the group size, the same on every rank); why it could not, or None."""
    from trl_fp8.hub import load_model_config
    from trl_fp8.rollout.vllm.attention import attention_heads, xqa_unavailable_reason

    heads = attention_heads(load_model_config(path))
    q_heads, kv_heads = heads["q_heads"], heads["kv_heads"]
    heads.update(q_heads=max(q_heads // tensor_parallel, 1), kv_heads=max(kv_heads // tensor_parallel, 1))
    return xqa_unavailable_reason(**heads)
