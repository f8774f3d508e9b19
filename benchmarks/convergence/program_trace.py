"""The long-completion convergence task: trace a straight-line program, writing every variable's value.

A prompt is a program of `K` assignments over variables named from a vocabulary of several thousand identifiers,
with values modulo 100; the completion evaluates it line by line and ends with the last variable's value:

    prompt:      v3051 = 37 ; v12 = v3051 + 45 ; v877 = v12 - 91 ; v40 = v877 + v3051 ; trace
    completion:  v3051 = 37 ; v12 = 82 ; v877 = 91 ; v40 = 28 ; answer 28 <eos>

Every step is one retrieval (an earlier variable's value, up to hundreds of tokens back) and one modular addition or
subtraction, and one wrong step makes every later value that depends on it wrong: errors, and trainer-vs-rollout
mismatch, can compound with completion length. The completion is `4 K + 2` tokens (130 to 770 for the default
`K` of 32 to 192). The vocabulary is word level: `NAMES` identifiers, the numbers 0-99 and a few words, padded to a
multiple of 128 like every model dim here (the conversion keeps `lm_head` in BF16 all the same, and the softmax over
4k entries is the trainer's and vLLM's own). The reward is exact: the final value must be right.
"""

from __future__ import annotations

import random

from task_utils import greedy_completions, right_padded

NAMES = 4000  # variable identifiers v0 .. v3999
MODULUS = 100
STEPS = (32, 192)  # assignments per program, inclusive
WORDS = ("=", "+", "-", ";", "trace", "answer")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
VOCAB = (*SPECIAL_TOKENS, *WORDS, *(str(n) for n in range(MODULUS)), *(f"v{i}" for i in range(NAMES)))
VOCAB_SIZE = (len(VOCAB) + 127) // 128 * 128  # 4224: ids past the words stay unused


def program(rng: random.Random, steps: tuple[int, int] = STEPS) -> tuple[str, list[tuple[str, int]]]:
    """A random program and its trace `[(name, value), ...]`. The first line assigns a constant; each later line
    assigns a constant plus or minus an earlier variable, or the sum or difference of two earlier variables."""
    k = rng.randint(*steps)
    names = [f"v{i}" for i in rng.sample(range(NAMES), k)]
    values: dict[str, int] = {}
    lines, trace = [], []
    for i, name in enumerate(names):
        if i == 0:
            value = rng.randrange(MODULUS)
            expr = str(value)
        elif i == 1 or rng.random() < 0.5:  # earlier variable op constant
            src, op, c = rng.choice(names[:i]), rng.choice("+-"), rng.randrange(MODULUS)
            value, expr = _apply(values[src], op, c), f"{src} {op} {c}"
        else:  # earlier variable op earlier variable
            (a, b), op = rng.sample(names[:i], 2), rng.choice("+-")
            value, expr = _apply(values[a], op, values[b]), f"{a} {op} {b}"
        values[name] = value
        lines.append(f"{name} = {expr} ;")
        trace.append((name, value))
    return " ".join(lines) + " trace", trace


def _apply(x: int, op: str, y: int) -> int:
    return (x + y) % MODULUS if op == "+" else (x - y) % MODULUS


def completion(trace: list[tuple[str, int]]) -> str:
    """The written-out evaluation (without the end token): every value, then the answer."""
    return " ".join(f"{name} = {value} ;" for name, value in trace) + f" answer {trace[-1][1]}"


def problems(n: int, seed: int, steps: tuple[int, int] = STEPS) -> list[tuple[str, str]]:
    """`n` (prompt, full reference completion) pairs; the answer is the completion's last word."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, trace = program(rng, steps)
        out.append((prompt, completion(trace)))
    return out


def answer_of(text: str) -> str | None:
    """The value after the last `answer` in a completion, or None when there is none."""
    words = text.split()
    for i in range(len(words) - 2, -1, -1):
        if words[i] == "answer":
            return words[i + 1]
    return None


def evaluate(prompt: str) -> list[tuple[str, int]]:
    """The trace of a prompt, computed from its text alone (an independent check of `program`)."""
    values: dict[str, int] = {}
    trace = []
    for line in prompt.removesuffix(" trace").split(" ;"):
        words = line.split()
        if not words:
            continue
        name, expr = words[0], words[2:]
        value = values[expr[0]] if expr[0] in values else int(expr[0])
        if len(expr) == 3:
            other = values[expr[2]] if expr[2] in values else int(expr[2])
            value = _apply(value, expr[1], other)
        values[name] = value
        trace.append((name, value))
    return trace


def tokenizer():
    """A word-level fast tokenizer over `VOCAB` (whitespace split), built in memory; left padding for generation."""
    from trl_fp8.tiny_model import word_tokenizer

    return word_tokenizer(VOCAB, pad="<pad>", eos="<eos>", unk="<unk>")


MODEL_KWARGS = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=2048)


def max_completion_length(steps: tuple[int, int] = STEPS) -> int:
    return 4 * steps[1] + 3  # the longest trace, its answer and the end token


class Batcher:
    """prompt + reference completion + <eos>, right padded; the loss covers the completion and the end token."""

    def __init__(self, tok):
        self.ids = tok.get_vocab()
        self.eos, self.pad = tok.eos_token_id, tok.pad_token_id

    def words(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]

    def __call__(self, pairs, device):
        return right_padded([(self.words(q), self.words(a) + [self.eos]) for q, a in pairs], self.pad, device)


def grpo_dataset(n: int, seed: int):
    """`datasets.Dataset` of plain-text prompts and the `answer` column the reward reads."""
    from datasets import Dataset

    pairs = problems(n, seed)
    return Dataset.from_dict({"prompt": [q for q, _ in pairs], "answer": [answer_of(a) for _, a in pairs]})


def exact_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final `answer` value is right, else 0.0 (TRL reward fn)."""
    return [float(answer_of(c) == a) for c, a in zip(completions, answer, strict=True)]


def greedy_accuracy(model, tok, pairs: list[tuple[str, str]], batch_size: int = 64, max_new_tokens: int | None = None):
    """Fraction of `pairs` whose greedy completion ends with the right answer (the model's own forward)."""
    texts = greedy_completions(
        model, tok, [q for q, _ in pairs], batch_size, max_new_tokens or max_completion_length()
    )
    return sum(answer_of(t) == answer_of(a) for t, (_, a) in zip(texts, pairs, strict=True)) / len(pairs)
