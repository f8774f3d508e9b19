"""A synthetic task with an exact verifier, for demos and tests without downloads: "say <letter>".

The prompt asks for a letter; the reward is the fraction of the first `length` completion characters that are that
letter, and a greedy answer is correct when it is the letter `length` times. A randomly initialised tiny model
cannot climb it (GRPO from scratch collapses onto one letter: reward 1/8, right for that letter only), so the demo
starts from `warm_start`: a brief supervised pass on noisy answers that leaves a policy which samples the right
letter about 40% of the time but is greedily right for only some letters. GRPO then has to make it right for all of
them, and `greedy_accuracy` over every letter, before and after, shows whether it did.
"""

from __future__ import annotations

import random

import torch

LETTERS = "abcdefgh"
ANSWER_LENGTH = 8

# GRPO settings shared by the tests, the demo and the notebook. From a random initialisation (the smoke tests) the
# reward rises within minutes on a CPU; from `warm_start`, use WARM_START_GRPO_SETTINGS.
GRPO_SETTINGS = dict(
    learning_rate=2e-3,
    lr_scheduler_type="constant",
    per_device_train_batch_size=32,
    num_generations=8,
    max_completion_length=ANSWER_LENGTH,
    temperature=1.0,
    beta=0.0,
    gradient_checkpointing=False,
    save_strategy="no",
    report_to="none",
    seed=0,
)
# From `warm_start`: the policy is sharpened, not rebuilt. A small learning rate, 8 prompts per step and a KL
# anchor keep GRPO from collapsing onto one letter, as it does from there with GRPO_SETTINGS (4 prompts per step, no
# KL; what each gave: docs/contributing/engineering-notes.md, "The demo's settings").
WARM_START_GRPO_SETTINGS = dict(GRPO_SETTINGS, learning_rate=2e-4, per_device_train_batch_size=64, beta=0.04)

# The demo's recipe (`examples/grpo_fp8.py`, the quickstart notebook, the learning test): 60 steps from `warm_start`
# at twice that learning rate (the lower one left a seed behind after 60 steps: docs/contributing/engineering-notes.md,
# "The demo's settings"), with TRL's default seed.
DEMO_GRPO_SETTINGS = dict(WARM_START_GRPO_SETTINGS, learning_rate=4e-4, seed=42)
DEMO_MAX_STEPS = 60
# What the demo printed (greedy accuracy over the 8 letters, warm start -> reloaded FP8 checkpoint) per seed, as
# docs/getting-started.md, "The demo's result", gives it with the CPU, threads and torch it was measured with. Other
# CPUs may round sums differently, and sampling amplifies that: a different figure is not a bug, no gain would be.
DEMO_MEASURED = {42: (0.25, 1.0), 0: (0.375, 0.625), 1: (0.375, 0.875), 2: (0.625, 1.0), 3: (0.625, 0.875),
                 4: (0.375, 1.0)}  # fmt: skip


def demo_measured_range() -> str:
    """One line on what `DEMO_MEASURED` holds, printed by the demo beside its own result."""
    before = [b for b, _ in DEMO_MEASURED.values()]
    after = [a for _, a in DEMO_MEASURED.values()]
    gains = [a - b for b, a in DEMO_MEASURED.values()]
    default = DEMO_MEASURED[DEMO_GRPO_SETTINGS["seed"]]
    seeds = ", ".join(str(seed) for seed in sorted(DEMO_MEASURED))
    pct = lambda x: f"{100 * x:g}%"  # noqa: E731
    return (
        f"measured for this demo in FP8 (seeds {seeds}; 2 and 8 threads alike; one 2-core CPU): default seed "
        f"{DEMO_GRPO_SETTINGS['seed']}: {pct(default[0])} -> {pct(default[1])}; over the seeds: {pct(min(before))}-"
        f"{pct(max(before))} -> {pct(min(after))}-{pct(max(after))}, a gain of {100 * min(gains):g} to "
        f"{100 * max(gains):g} points"
    )


def say_letter_dataset(n: int = 1024, seed: int = 0, letters: str = LETTERS):
    """A `datasets.Dataset` of conversational prompts `[{"role": "user", "content": "say c"}]` with a `letter` column."""
    from datasets import Dataset

    rng = random.Random(seed)
    picks = [rng.choice(letters) for _ in range(n)]
    return Dataset.from_dict({"prompt": [_prompt(c) for c in picks], "letter": picks})


def say_letter_reward(completions, letter, length: int = ANSWER_LENGTH, **kwargs) -> list[float]:
    """Fraction of the first `length` characters of each completion equal to its prompt's letter (TRL reward fn)."""
    rewards = []
    for completion, target in zip(completions, letter, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        rewards.append(text[:length].count(target) / length)
    return rewards


def _prompt(letter: str) -> list[dict]:
    return [{"role": "user", "content": f"say {letter}"}]


def _prompt_ids(tokenizer, letter: str) -> list[int]:
    text = tokenizer.apply_chat_template(_prompt(letter), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def warm_start(
    model,
    tokenizer,
    steps: int = 100,
    learning_rate: float = 2e-3,
    batch_size: int = 32,
    p_correct: float = 0.4,
    seed: int = 0,
) -> list[float]:
    """Supervised warm start on noisy answers, in place; returns the loss per step.

    Each example answers "say c" with the right letter repeated with probability `p_correct`, otherwise with the next
    letter (c -> d), so the policy learns the format and samples the right letter sometimes, while its greedy answer
    is often the wrong one. A plain loop rather than TRL's SFTTrainer: the demo runs it on the main process only,
    inside a multi-process launch, where a Trainer would try to join the other ranks.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    pad_id = tokenizer.pad_token_id
    losses = []
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            letter = rng.choice(LETTERS)
            answer = letter if rng.random() < p_correct else LETTERS[(LETTERS.index(letter) + 1) % len(LETTERS)]
            prompt = _prompt_ids(tokenizer, letter)
            completion = tokenizer(answer * ANSWER_LENGTH, add_special_tokens=False)["input_ids"]
            rows.append((prompt, completion + [tokenizer.eos_token_id]))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (p, c) in enumerate(rows):  # right-padded; loss on the completion only
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            mask[i, : len(p) + len(c)] = 1
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def greedy_answers(model, tokenizer, letters: str = LETTERS) -> dict[str, str]:
    """The greedy completion (first `ANSWER_LENGTH` characters) to "say <letter>" for every letter."""
    device = next(model.parameters()).device
    answers = {}
    for letter in letters:
        ids = torch.tensor([_prompt_ids(tokenizer, letter)], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_LENGTH, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        answers[letter] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)[:ANSWER_LENGTH]
    return answers


@torch.no_grad()
def sampled_reward(model, tokenizer, samples: int = 64, seed: int = 0, letters: str = LETTERS) -> float:
    """Mean `say_letter_reward` of `samples` answers sampled per letter as GRPO samples them (temperature 1, no top-k
    or top-p), with a fixed seed: the expected reward on a fixed evaluation set, which a training log's few
    completions a step estimate too noisily to compare two points of a short run."""
    device = next(model.parameters()).device
    rewards = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the caller's RNGs untouched
        torch.manual_seed(seed)
        for letter in letters:
            ids = torch.tensor([_prompt_ids(tokenizer, letter)] * samples, device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_LENGTH,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            completions = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
            rewards += say_letter_reward(completions, [letter] * samples)
    return sum(rewards) / len(rewards)


def greedy_accuracy(model, tokenizer, letters: str = LETTERS) -> tuple[float, dict[str, str]]:
    """Fraction of letters whose greedy answer is exactly the letter `ANSWER_LENGTH` times, and the answers."""
    answers = greedy_answers(model, tokenizer, letters)
    correct = sum(answers[c] == c * ANSWER_LENGTH for c in letters)
    return correct / len(letters), answers
