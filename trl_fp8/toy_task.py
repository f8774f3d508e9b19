"""A synthetic task with an exact verifier, for demos and tests without downloads: "say <letter>".

The prompt asks for a letter; the reward is the fraction of the first `length` completion characters that are that
letter. A randomly initialised tiny model starts near 0 and GRPO raises it within minutes on a CPU, which makes the
trend a visible check that the whole loop (rollouts, rewards, FP8 training) works.
"""

from __future__ import annotations

import random

LETTERS = "abcdefgh"

# GRPO settings under which a randomly initialised tiny Qwen3 learns the task within minutes on a CPU (measured with
# seed 0: mean reward 0.02 over the first 5 steps, 0.24 over steps 31-40). Shared by the demo, notebook and tests.
GRPO_SETTINGS = dict(
    learning_rate=2e-3,
    lr_scheduler_type="constant",
    per_device_train_batch_size=32,
    num_generations=8,
    max_completion_length=8,
    temperature=1.0,
    beta=0.0,
    gradient_checkpointing=False,
    save_strategy="no",
    report_to="none",
    seed=0,
)


def say_letter_dataset(n: int = 1024, seed: int = 0, letters: str = LETTERS):
    """A `datasets.Dataset` of conversational prompts `[{"role": "user", "content": "say c"}]` with a `letter` column."""
    from datasets import Dataset

    rng = random.Random(seed)
    picks = [rng.choice(letters) for _ in range(n)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {c}"}] for c in picks], "letter": picks})


def say_letter_reward(completions, letter, length: int = 8, **kwargs) -> list[float]:
    """Fraction of the first `length` characters of each completion equal to its prompt's letter (TRL reward fn)."""
    rewards = []
    for completion, target in zip(completions, letter, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        rewards.append(text[:length].count(target) / length)
    return rewards
