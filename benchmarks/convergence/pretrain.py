"""Pre-train the convergence model: a Qwen3-architecture model (dims multiples of 128) taught multi-digit addition
by supervised training on generated problems, stopped once it solves part of the held-out set.

    python benchmarks/convergence/pretrain.py --out /tmp/arith-base            # GPU host, a few minutes

Writes the model and tokenizer to `--out` and `benchmarks/results/convergence/pretrain_<device>.json` (loss and
held-out greedy accuracy per evaluation). GRPO then starts from `--out` (`run_grpo.py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from arithmetic import chat_prompt, greedy_accuracy, problems  # noqa: E402
from common import versions  # noqa: E402

SIZES = {  # hidden, layers, heads (head_dim 128), kv heads, intermediate
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=6, num_key_value_heads=2,
                 intermediate_size=2048),  # 76M parameters
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=768),  # ~3M: a CPU check that the task is learnable
    "smoke": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                  intermediate_size=256),
}  # fmt: skip


def build(size: str, seed: int):
    import torch

    from trl_fp8.tiny_model import tiny_char_tokenizer, tiny_qwen3

    tokenizer = tiny_char_tokenizer()
    torch.manual_seed(seed)
    model = tiny_qwen3(
        seed=seed, vocab_size=128, head_dim=128, max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **SIZES[size],
    )  # fmt: skip
    return model, tokenizer


class Batcher:
    """Chat-formatted prompt + answer + <|im_end|>, right padded; the loss covers the answer and the end token only.

    The tokenizer is character level, so a row is the chat template's fixed prefix and suffix around the question's
    characters: built from ids directly, rendering the template once rather than 512 times a step (that, not the GPU,
    was the pre-training bottleneck). The first rows are checked against the full tokenization.
    """

    def __init__(self, tokenizer):
        before, after = chat_prompt(tokenizer, "\x00").split("\x00")
        self.tokenizer = tokenizer
        self.prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
        self.suffix = tokenizer(after, add_special_tokens=False)["input_ids"]
        self.ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "0123456789+="}
        for q, a in problems(4, seed=123):
            full = tokenizer(chat_prompt(tokenizer, q) + a, add_special_tokens=False)["input_ids"]
            assert full == self.prompt(q) + self.chars(a), "character-level shortcut disagrees with the tokenizer"

    def chars(self, text: str) -> list[int]:
        return [self.ids[c] for c in text]

    def prompt(self, question: str) -> list[int]:
        return self.prefix + self.chars(question) + self.suffix

    def __call__(self, pairs, device):
        import torch

        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        rows = [(self.prompt(q), self.chars(a) + [eos]) for q, a in pairs]
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.tensor([p + a + [pad] * (width - len(p) - len(a)) for p, a in rows])
        labels = torch.tensor([[-100] * len(p) + a + [-100] * (width - len(p) - len(a)) for p, a in rows])
        return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def main():
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", choices=list(SIZES), default="base")
    parser.add_argument("--max_steps", type=int, default=6000)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval_every", type=int, default=250)
    parser.add_argument("--eval_problems", type=int, default=512)
    parser.add_argument("--target_accuracy", type=float, default=0.35, help="stop once held-out accuracy reaches it")
    parser.add_argument("--max_minutes", type=float, default=8.0, help="stop at the next evaluation after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=None)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = build(args.size, args.seed)
    model.to(device)
    tokenizer.padding_side = "left"  # generation; training batches are built by hand (right padded)
    params = sum(p.numel() for p in model.parameters())
    held_out = problems(args.eval_problems, seed=10_000 + args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 200))
    batcher = Batcher(tokenizer)
    log, start = [], time.time()
    step = 0
    for step in range(1, args.max_steps + 1):
        ids, labels = batcher(problems(args.batch_size, seed=args.seed * 1_000_003 + step), device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.max_steps:
            accuracy = greedy_accuracy(model, tokenizer, held_out)
            log.append({"step": step, "loss": loss.item(), "held_out_accuracy": accuracy, "s": time.time() - start})
            print(json.dumps(log[-1]), flush=True)
            if accuracy >= args.target_accuracy or time.time() - start > 60 * args.max_minutes:
                break

    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result = {
        "run": "pretrain (supervised) on multi-digit addition",
        "device": device_name,
        "date": datetime.date.today().isoformat(),
        "versions": versions("torch", "transformers"),
        "size": {"name": args.size, "parameters": params, **SIZES[args.size]},
        "args": vars(args),
        "steps": step,
        "log": log,
    }
    default = HERE.parents[0] / "results" / "convergence" / f"pretrain_{device_name.replace(' ', '_')}.json"
    out = Path(args.results or default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{params / 1e6:.0f}M parameters, {step} steps, held-out accuracy {log[-1]['held_out_accuracy']:.3f}")


if __name__ == "__main__":
    main()
