"""Pre-train the convergence model: a Qwen3-architecture model (dims multiples of 128) taught a task (`--task`:
multi-digit addition, or tracing a program with completions of hundreds of words) by supervised training on
generated problems, stopped once it solves part of the held-out set.

    python -m benchmarks.convergence.pretrain --out /tmp/arith-base            # GPU host, a few minutes
    python -m benchmarks.convergence.pretrain --task chain --size medium --out /tmp/chain-base

Writes the model and tokenizer to `--out` and `benchmarks/results/convergence/pretrain_<device>.json` (loss and
held-out greedy accuracy per evaluation). GRPO then starts from `--out` (`run_grpo.py`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.common import RESULTS, arg_parser, device_name, metadata, write_json

TASKS = {  # --task: the module of benchmarks.convergence that defines it
    "addition": "arithmetic",  # multi-digit addition, answers of at most 7 characters
    "chain": "addition_chain",  # a running sum written out term by term: completions of 140-860 words
    "chain_long": "addition_chain_long",  # the same with 96-160 terms: completions of 860-1,436 words
}


def load_task(name: str):
    import importlib

    return importlib.import_module(f"benchmarks.convergence.{TASKS[name]}")


def results_folder(task: str) -> Path:
    """`benchmarks/results/convergence` for addition (the first report's runs), `convergence_<task>` otherwise."""
    return RESULTS / ("convergence" if task == "addition" else f"convergence_{task}")


SIZES = {  # hidden, layers, heads (head_dim 128), kv heads, intermediate
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=6, num_key_value_heads=2,
                 intermediate_size=2048),  # 76M parameters
    "medium": dict(hidden_size=768, num_hidden_layers=16, num_attention_heads=6, num_key_value_heads=2,
                   intermediate_size=2048),  # 101M with the chain task's vocabulary 4k
    "large": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=3072),  # a larger model for harder tasks
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=768),  # ~3M: CPU learnability checks
    "smoke": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                  intermediate_size=256),
}  # fmt: skip


def build(task, size: str, seed: int):
    import torch

    from trl_fp8.demo.tiny_model import tiny_qwen3

    tokenizer = task.tokenizer()
    torch.manual_seed(seed)
    model = tiny_qwen3(
        seed=seed, head_dim=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **task.MODEL_KWARGS, **SIZES[size],
    )  # fmt: skip
    return model, tokenizer


def train_step(model, optimizer, schedule, ids, labels, micro_batch: int | None = None):
    """One supervised step (BF16 autocast on CUDA, gradients clipped at 1); returns the loss, detached. With
    `micro_batch`, the batch runs in slices of that many rows whose gradients add up to the whole batch's: each slice's
    mean loss is weighted by its share of the batch's labelled tokens, so long sequences fit a smaller GPU."""
    import torch

    device = ids.device.type
    counted = (labels[:, 1:] != -100).sum()  # the tokens the causal LM loss averages over (labels shift by one)
    total = ids.new_zeros((), dtype=torch.float32)
    rows = micro_batch or ids.shape[0]
    for start in range(0, ids.shape[0], rows):
        part_ids, part_labels = ids[start : start + rows], labels[start : start + rows]
        share = (part_labels[:, 1:] != -100).sum() / counted.clamp(min=1)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=part_ids, labels=part_labels).loss * share
        loss.backward()
        total += loss.detach().float()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def main():
    import torch

    parser = arg_parser(__doc__)
    parser.add_argument("--out", required=True, help="the model folder")
    parser.add_argument("--task", choices=list(TASKS), default="addition")
    parser.add_argument("--size", choices=list(SIZES), default="base")
    parser.add_argument("--max_steps", type=int, default=6000)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument(
        "--micro_batch",
        type=int,
        default=None,
        help="rows per forward/backward, the gradients of a step added up (default: the whole batch)",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval_every", type=int, default=250)
    parser.add_argument("--eval_problems", type=int, default=512)
    parser.add_argument("--target_accuracy", type=float, default=0.35, help="stop once held-out accuracy reaches it")
    parser.add_argument("--max_minutes", type=float, default=8.0, help="evaluate and stop after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--results", default=None, help="results JSON (default: results_folder(task)/pretrain_<device>.json)"
    )
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    task = load_task(args.task)
    model, tokenizer = build(task, args.size, args.seed)
    model.to(device)
    tokenizer.padding_side = "left"  # generation; training batches are built by hand (right padded)
    params = sum(p.numel() for p in model.parameters())
    held_out = task.problems(args.eval_problems, seed=10_000 + args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 200))
    batcher = task.Batcher(tokenizer)
    log, start = [], time.time()
    step = 0
    # a task may pre-train on a wider range of lengths than it is judged on (`PRETRAIN_TERMS`)
    lengths = {"steps": task.PRETRAIN_TERMS} if hasattr(task, "PRETRAIN_TERMS") else {}
    for step in range(1, args.max_steps + 1):
        ids, labels = batcher(task.problems(args.batch_size, seed=args.seed * 1_000_003 + step, **lengths), device)
        loss = train_step(model, optimizer, schedule, ids, labels, args.micro_batch)
        out_of_time = time.time() - start > 60 * args.max_minutes
        if step % args.eval_every == 0 or step == args.max_steps or out_of_time:
            accuracy = task.greedy_accuracy(model, tokenizer, held_out)
            log.append({"step": step, "loss": loss.item(), "held_out_accuracy": accuracy, "s": time.time() - start})
            print(json.dumps(log[-1]), flush=True)
            if accuracy >= args.target_accuracy or out_of_time:
                break

    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    name = device_name()
    result = {
        "run": f"pretrain (supervised) on {args.task} ({TASKS[args.task]})",
        **metadata(name),
        "size": {"name": args.size, "parameters": params, **SIZES[args.size]},
        "args": vars(args),
        "steps": step,
        "log": log,
    }
    default = results_folder(args.task) / f"pretrain_{name.replace(' ', '_')}.json"
    write_json(args.results or default, result, indent=1)
    print(f"{params / 1e6:.0f}M parameters, {step} steps, held-out accuracy {log[-1]['held_out_accuracy']:.3f}")


if __name__ == "__main__":
    main()
