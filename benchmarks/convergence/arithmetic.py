"""The convergence task: multi-digit addition with an exact verifier.

A prompt is one user message `"4821+377="`; the answer is the decimal sum. The character tokenizer of
`trl_fp8.demo.tiny_model` covers it, so nothing is downloaded. Difficulty grows with the number of digits, which lets a
briefly pre-trained model solve only part of the problems: room for GRPO to improve and for precision to matter.

A convergence task module (`pretrain.py --task`, `run_grpo.py --task`) provides `problems`, `tokenizer`,
`MODEL_KWARGS`, `max_completion_length`, `Batcher`, `grpo_dataset`, `exact_answer_reward` and `greedy_accuracy`;
`addition_chain.py` is the long-completion one.
"""

from __future__ import annotations

import random

from benchmarks.convergence.task_utils import greedy_completions, right_padded

DIGITS = (2, 5)  # operand lengths, inclusive
MODEL_KWARGS = dict(vocab_size=128, max_position_embeddings=128)


def tokenizer():
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer

    return tiny_char_tokenizer()


def max_completion_length() -> int:
    return 8  # the longest sum (6 digits), with room for the end token


def _number(rng: random.Random, digits: tuple[int, int]) -> int:
    d = rng.randint(*digits)
    return rng.randint(10 ** (d - 1), 10**d - 1)


def problem(rng: random.Random, digits: tuple[int, int] = DIGITS) -> tuple[str, str]:
    a, b = _number(rng, digits), _number(rng, digits)
    return f"{a}+{b}=", str(a + b)


def problems(n: int, seed: int, digits: tuple[int, int] = DIGITS) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [problem(rng, digits) for _ in range(n)]


def grpo_dataset(n: int, seed: int):
    """`datasets.Dataset` with conversational `prompt` and the `answer` column the reward reads."""
    from datasets import Dataset

    pairs = problems(n, seed)
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": q}] for q, _ in pairs], "answer": [a for _, a in pairs]}
    )


def exact_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is exactly the sum (surrounding whitespace ignored), else 0.0 (TRL reward fn)."""
    out = []
    for completion, target in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(float(text.strip() == target))
    return out


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


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
        eos = self.tokenizer.eos_token_id
        return right_padded(
            [(self.prompt(q), self.chars(a) + [eos]) for q, a in pairs], self.tokenizer.pad_token_id, device
        )


def greedy_accuracy(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 512, max_new_tokens: int = 8):
    """Fraction of `pairs` the model answers exactly with greedy decoding (the model's own forward, FP8 or not)."""
    prompts = [chat_prompt(tokenizer, q) for q, _ in pairs]
    texts = greedy_completions(model, tokenizer, prompts, batch_size, max_new_tokens)
    return sum(t.strip() == a for t, (_, a) in zip(texts, pairs, strict=True)) / len(pairs)
