"""Can a small model learn the steps of a long-completion task? A CPU check before GPU time goes into the study.

    python benchmarks/convergence/probe_learnability.py --task chain --steps 8 24     # ~30 min on 2 CPU cores

Supervised training of a small Qwen3 (`pretrain.SIZES`) on short problems (`--steps`: terms or program lines),
logging on held-out problems the teacher-forced accuracy of each kind of written step (the task's `step_roles`: the
next line number, a copy, a look-up, one modular sum, ...) and the greedy accuracy of the final answer. Writes
`benchmarks/results/convergence_<task>/learnability_cpu.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import versions  # noqa: E402
from pretrain import SIZES, TASKS, build, load_task, results_folder, train_step  # noqa: E402


def step_accuracy(task, model, batcher, pairs) -> dict[str, float]:
    """Teacher-forced next-word accuracy on the completions of `pairs`, by kind of step (`end`: the end token)."""
    import torch

    hits: dict[str, list[int]] = {}
    model.eval()
    with torch.no_grad():
        ids, labels = batcher(pairs, "cpu")
        predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)
        for row, (prompt, _) in enumerate(pairs):
            roles = task.step_roles(prompt) + ["end"]
            targets = (labels[row, 1:] != -100).nonzero().flatten()
            assert len(targets) == len(roles)
            for position, role in zip(targets.tolist(), roles, strict=True):
                hits.setdefault(role, []).append(int(predicted[row, position] == labels[row, position + 1]))
    model.train()
    return {role: sum(h) / len(h) for role, h in sorted(hits.items())}


def main():
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=[t for t in TASKS if t != "addition"], default="chain")
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--steps", type=int, nargs=2, default=(8, 24), help="terms or program lines (min max)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max_minutes", type=float, default=35.0)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--eval_problems", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default results/convergence_<task>/learnability_cpu.json")
    args = parser.parse_args()
    task = load_task(args.task)

    torch.manual_seed(args.seed)
    model, tokenizer = build(task, args.size, args.seed)
    tokenizer.padding_side = "left"
    batcher = task.Batcher(tokenizer)
    steps = tuple(args.steps)
    held_out = task.problems(args.eval_problems, seed=10_000 + args.seed, steps=steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    log, start, step = [], time.time(), 0
    while time.time() - start < 60 * args.max_minutes:
        step += 1
        ids, labels = batcher(task.problems(args.batch_size, seed=args.seed * 1_000_003 + step, steps=steps), "cpu")
        loss = train_step(model, optimizer, schedule, ids, labels)
        if step % args.eval_every == 0:
            log.append({"step": step, "s": round(time.time() - start), "loss": loss.item(),
                        "step_accuracy": step_accuracy(task, model, batcher, held_out)})  # fmt: skip
            print(json.dumps(log[-1]), flush=True)
    answer_accuracy = task.greedy_accuracy(
        model, tokenizer, held_out, max_new_tokens=task.max_completion_length(steps)
    )
    result = {
        "run": f"{task.__name__} learnability probe (supervised, CPU)",
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
        "versions": versions("torch", "transformers"),
        "size": {"name": args.size, "parameters": sum(p.numel() for p in model.parameters()), **SIZES[args.size]},
        "args": vars(args),
        "steps": step,
        "log": log,
        "final_step_accuracy": step_accuracy(task, model, batcher, held_out),
        "greedy_answer_accuracy": answer_accuracy,
        "chance_answer_accuracy": 1 / task.MODULUS,
    }
    out = Path(args.out or results_folder(args.task) / "learnability_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{step} steps; greedy answer accuracy {answer_accuracy:.3f}; by step kind {result['final_step_accuracy']}")


if __name__ == "__main__":
    main()
