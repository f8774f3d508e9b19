"""Do FP8 experts learn as BF16 ones do? A CPU study at tiny mixture-of-experts scale (the MoE issue's accuracy item).

    python -m benchmarks.convergence.moe_study --seeds 0 1 2 --out benchmarks/results/moe_study_cpu.json

A tiny Qwen3-MoE (8 experts, top-2, every layer sparse; dims multiples of 128) gets the demo's supervised warm start
on "say <letter>", then GRPO in BF16 and in FP8 (blockwise, experts included) from the same start, per seed. Each run
records the reward per step and the greedy accuracy over every letter (the prompts it trains on) of the saved checkpoint, reloaded;
the FP8 run also records how often the router's top-k choice differs between the FP8 model and a BF16 model with the
same master weights (every layer, every token of a fixed batch of prompts and completions), at the start and end.
CPU only: the FP8 GEMMs are the exact emulation, so this measures the precision flow, not speed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, arg_parser, metadata, write_json


def tiny_moe(tokenizer, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=128, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=0)  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def router_choices(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The top-k expert set of every token at every MoE layer (sorted indices), for one forward of `ids`."""
    choices = []
    hooks = [
        mod.register_forward_hook(lambda m, args, out: choices.append(out[2].sort(dim=-1).values))
        for name, mod in model.named_modules()
        if name.endswith("mlp.gate")
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return choices


def topk_disagreement(fp8_model, ids: torch.Tensor) -> float:
    """Fraction of (token, MoE layer) whose top-k set differs between `fp8_model` and the same model computing in
    high precision (its FP8 modules switched to their plain classes for one forward: the same master weights)."""
    ours = router_choices(fp8_model, ids)
    switched = []
    for module in fp8_model.modules():
        if type(module).__name__.startswith("FP8"):
            base = next(b for b in type(module).__mro__[1:] if b.__module__.startswith(("torch.nn", "transformers")))
            switched.append((module, type(module)))
            module.__class__ = base
    try:
        theirs = router_choices(fp8_model, ids)
    finally:
        for module, cls in switched:
            module.__class__ = cls
    differ = sum(int((a != b).any(-1).sum()) for a, b in zip(ours, theirs, strict=True))
    return differ / sum(a.shape[0] for a in ours)


def run(args, seed: int, recipe: str | None) -> dict:
    from transformers import AutoModelForCausalLM

    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer
    from trl_fp8.demo.toy_task import (
        WARM_START_GRPO_SETTINGS,
        greedy_accuracy,
        say_letter_dataset,
        say_letter_reward,
        warm_start,
    )

    tokenizer = tiny_char_tokenizer()
    model = tiny_moe(tokenizer, seed)
    warm_start(model, tokenizer, seed=seed)
    before, _ = greedy_accuracy(model, tokenizer)
    work = Path(args.workdir) / f"seed{seed}_{recipe or 'bf16'}"
    model.save_pretrained(work / "init")
    config = FP8GRPOConfig(**{**WARM_START_GRPO_SETTINGS, "seed": seed}, output_dir=str(work / "out"),
                           max_steps=args.steps, logging_steps=1, use_cpu=True, bf16=False, disable_tqdm=True,
                           fp8_recipe=recipe, save_fp8_checkpoint=recipe is not None)  # fmt: skip
    trainer = FP8GRPOTrainer(str(work / "init"), say_letter_reward, config, train_dataset=say_letter_dataset(seed=seed),
                             processing_class=tokenizer)  # fmt: skip
    probe = torch.randint(4, 84, (8, 24), generator=torch.Generator().manual_seed(seed))
    row = {"seed": seed, "recipe": recipe or "bf16", "accuracy_before": before}
    if recipe is not None:
        row["router_topk_disagreement_start"] = topk_disagreement(trainer.model, probe)
    start = time.perf_counter()
    trainer.train()
    row["train_seconds"] = time.perf_counter() - start
    if recipe is not None:
        row["router_topk_disagreement_end"] = topk_disagreement(trainer.model, probe)
    trainer.save_model(str(work / "saved"))
    row["accuracy_after"], row["answers_after"] = greedy_accuracy(AutoModelForCausalLM.from_pretrained(work / "saved"),
                                                                  tokenizer)  # fmt: skip
    row["reward"] = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    print(json.dumps({k: v for k, v in row.items() if k != "reward"}), flush=True)
    return row


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/moe_study_cpu.json", workdir="/tmp/trl_fp8_moe_study")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    out = args.out or RESULTS / "moe_study_cpu.json"

    result = {
        "benchmark": "tiny Qwen3-MoE, say-letter GRPO from a warm start: BF16 vs FP8 experts (CPU, exact emulation)",
        **metadata("cpu"),
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "runs": [],
    }
    for seed in args.seeds:
        for recipe in (None, "blockwise"):
            result["runs"].append(run(args, seed, recipe))
            write_json(out, result, indent=1)  # after every run: a cut-off keeps them
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
