"""`trl-fp8 plan`: what a colocated vLLM engine holds in BF16, FP8 and FP8 + FP8 KV cache, and whether training fits.

    trl-fp8 plan MODEL [--gpu H100 | --gpu_memory_gib 80] [--vllm_gpu_memory_utilization 0.3]
                 [--prompt_len 256] [--completion_len 2048] [--generation_batch 128] [--optim adamw_bnb_8bit] ...

MODEL is a model folder or a Hub id such as Qwen/Qwen3-8B (its config.json only: the Hub cache first; offline and
uncached it stops at once, naming the fix). The estimates are `trl_fp8.rollout.capacity`'s: KV-cache tokens
as vLLM 0.26 sizes them (within a few percent of what it reported in our benchmarks), sequences of
prompt + completion tokens that decode at once, a rough account of the trainer's memory beside the engine, and the
largest share at which each flow fits (its best fit).
"""

from __future__ import annotations

import argparse
import sys

from trl_fp8.cli.argtypes import memory_share, non_negative_int, positive_float, positive_int
from trl_fp8.cli.hub import load_model_config
from trl_fp8.rollout.capacity import (
    GPU_MEMORY_BYTES,
    OPTIMIZER_STATE_BYTES,
    GiB,
    ModelShape,
    rollout_capacity,
    trainer_memory_bytes,
    vllm_overhead_bytes,
)

FLOWS = (("BF16", False, False), ("FP8", True, False), ("FP8 + FP8 KV", True, True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hub id, e.g. Qwen/Qwen3-8B (only its config is read)")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", choices=sorted(GPU_MEMORY_BYTES), help="GPU kind (default: this machine's GPU)")
    gpu.add_argument("--gpu_memory_gib", type=positive_float, help="GPU memory in GiB, as CUDA reports it")
    parser.add_argument("--vllm_gpu_memory_utilization", type=memory_share, default=0.3,
                        help="vLLM's share of the GPU (TRL's colocate default)")  # fmt: skip
    parser.add_argument("--prompt_len", type=non_negative_int, default=256, help="prompt tokens")
    parser.add_argument("--completion_len", type=positive_int, default=2048, help="max_completion_length")
    parser.add_argument("--generation_batch", type=positive_int, default=128,
                        help="sequences per rollout (max_num_seqs)")  # fmt: skip
    parser.add_argument("--micro_batch", type=positive_int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--optim", default="adamw_torch", choices=sorted(OPTIMIZER_STATE_BYTES), help="optimizer")
    parser.add_argument("--no_gradient_checkpointing", action="store_true")
    parser.add_argument("--lora", action="store_true", help="only adapters train: no gradients or optimizer state")
    parser.add_argument("--sleep_mode", action="store_true", help="vllm_enable_sleep_mode: vLLM frees its share")
    parser.add_argument("--trust_remote_code", action="store_true")


def run(args: argparse.Namespace) -> int:
    seq_len = args.prompt_len + args.completion_len
    share = args.vllm_gpu_memory_utilization
    try:
        total = _gpu_memory(args)
        shape = ModelShape.from_config(load_model_config(args.model, args.trust_remote_code))
        # Every flow's numbers first: an error must come before any line of the table.
        rows = [_flow_row(shape, total, seq_len, args, fp8_weights=w, fp8_kv=kv) for _, w, kv in FLOWS]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model}: {shape.params / 1e9:.2f}B parameters ({shape.linear_params / 1e9:.2f}B in linear layers); "
          f"GPU {total / GiB:.1f} GiB, vLLM share {share:g}; {args.generation_batch} sequences of "
          f"{args.prompt_len} + {args.completion_len} tokens")  # fmt: skip
    print(f"{'':<14}{'vLLM weights':>13}{'KV B/token':>11}{'KV tokens':>11}{'seqs at once':>13}{'waves':>6}"
          f"{'trainer':>9}{'fits':>6}")  # fmt: skip
    for (name, _, _), (cap, parts, fits, _) in zip(FLOWS, rows, strict=True):
        waves = cap.waves(args.generation_batch) if cap.sequences else "-"
        print(f"{name:<14}{cap.weight_bytes / GiB:>11.1f}Gi{cap.kv_bytes_per_token:>11,}{cap.kv_tokens:>11,}"
              f"{cap.sequences:>13}{waves:>6}{sum(parts.values()) / GiB:>7.1f}Gi{'yes' if fits else 'no':>6}")  # fmt: skip
    print(
        "KV tokens: vLLM 0.26's sizing, estimated; trainer: BF16 masters, gradients, optimizer, FP8 weight cache, one "
        "micro-batch's activations and logits (rough); fits: trainer + vLLM's share within 97% of the GPU."
    )
    best_fits = [f"{name} {fit[0]:.2f} ({fit[1].kv_tokens:,} KV tokens, {fit[1].sequences} sequences at once)" if fit
                 else f"{name}: none (no share holds one sequence beside the trainer)"
                 for (name, _, _), (_, _, _, fit) in zip(FLOWS, rows, strict=True)]  # fmt: skip
    print("Best fit, the largest vLLM share that fits (steps of 0.05): " + "; ".join(best_fits) + ".")
    if args.sleep_mode:
        print(
            "Sleep mode: fits also checks the wake-up (weights + optimizer states + vLLM's whole share), assuming "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; without it PyTorch kept 10-14 GiB of freed training "
            "memory beside vLLM at the 8B shape, and a share 0.05-0.1 lower was the most that ran."
        )
    return 0


def _flow_row(shape, total: int, seq_len: int, args, *, fp8_weights: bool, fp8_kv: bool):
    """One flow's `(capacity, trainer memory parts, fits, best fit)`."""
    cap = rollout_capacity(shape, total, args.vllm_gpu_memory_utilization, fp8_weights=fp8_weights, fp8_kv=fp8_kv,
                           seq_len=seq_len, max_num_seqs=args.generation_batch)  # fmt: skip
    parts = trainer_memory_bytes(
        shape, optim=args.optim, fp8_training=fp8_weights, lora=args.lora, micro_batch=args.micro_batch,
        seq_len=seq_len, gradient_checkpointing=not args.no_gradient_checkpointing,
    )  # fmt: skip
    fits = peak_bytes(parts, shape, args.vllm_gpu_memory_utilization * total, args) <= 0.97 * total
    best = best_fit_share(parts, shape, total, seq_len, args, fp8_weights=fp8_weights, fp8_kv=fp8_kv)
    return cap, parts, fits, best


def peak_bytes(parts: dict[str, int], shape, share_bytes: float, args) -> float:
    """The most the GPU holds at once. Without sleep mode vLLM keeps its share beside training. With it, training
    runs beside what vLLM cannot release, and vLLM wakes into its whole share beside the trainer's weights and
    optimizer states (gradients and activations freed, the FP8 weight cache released before the KV cache wakes)."""
    if not args.sleep_mode:
        return sum(parts.values()) + share_bytes
    training = sum(parts.values()) + vllm_overhead_bytes(shape, args.generation_batch)
    return max(training, parts["weights"] + parts["optimizer"] + share_bytes)


def best_fit_share(parts: dict[str, int], shape, total: int, seq_len: int, args, *, fp8_weights: bool, fp8_kv: bool):
    """`(share, capacity there)` for the largest share, in steps of 0.05, at which the run fits and vLLM has room for
    one whole sequence: what a careful user tunes `vllm_gpu_memory_utilization` to. None if no share does."""
    for step in range(19, 0, -1):
        share = step / 20
        if peak_bytes(parts, shape, share * total, args) > 0.97 * total:
            continue
        cap = rollout_capacity(shape, total, share, fp8_weights=fp8_weights, fp8_kv=fp8_kv,
                               seq_len=seq_len, max_num_seqs=args.generation_batch)  # fmt: skip
        return (share, cap) if cap.sequences else None
    return None


def _gpu_memory(args) -> int:
    if args.gpu_memory_gib:
        return int(args.gpu_memory_gib * GiB)
    if args.gpu:
        return GPU_MEMORY_BYTES[args.gpu]
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"no GPU here: pass --gpu ({' or '.join(sorted(GPU_MEMORY_BYTES))}) or --gpu_memory_gib.")
    return torch.cuda.mem_get_info()[1]
