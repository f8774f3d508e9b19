"""The long-completion convergence task: trace a straight-line program, writing out every step of its evaluation.

A prompt is a numbered program of `K` assignments over variables named from a vocabulary of several thousand
identifiers, with values modulo 10. The completion walks it line by line: it copies the line, looks up the value of
each variable the line reads, does the one modular addition or subtraction, states the new value, and ends with the
last one:

    prompt:      L1 v3051 = 7 ; L2 v12 = v3051 + 5 ; L3 v40 = v12 - v3051 ; trace
    completion:  L1 v3051 = 7 ; v3051 is 7 ;
                 L2 v12 = v3051 + 5 ; v3051 is 7 ; 7 + 5 = 2 ; v12 is 2 ;
                 L3 v40 = v12 - v3051 ; v12 is 2 ; v3051 is 7 ; 2 - 7 = 5 ; v40 is 5 ; answer 5 <eos>

Every written word is one simple operation: the next line number, a copy from the program, a look-up of `<name> is`
where that variable was stated (up to hundreds of words back), or one entry of the modular addition table. So a
model of a few hundred million parameters can learn each step, and one wrong step makes every later value that
depends on it wrong: errors, and trainer-vs-rollout mismatch, compound with completion length. A line costs 9 to 25
words: completions are 160 to 940 words (mean 540) for the default `K` of 8 to 40. The vocabulary is word level: `NAMES`
identifiers, the line numbers, the digits and a few words, padded to a multiple of 128 like every model dim
here (the conversion keeps `lm_head` in BF16 all the same, and the softmax over 4k entries is the trainer's and
vLLM's own). The reward is exact: the final value must be right.

The first long task, kept for its record: a 107M model pre-trained on it for 5.5 minutes on an H200 stayed at chance
(`results/convergence_trace/pretrain_NVIDIA_H200.json`), so the study runs on `addition_chain.py`.
"""

from __future__ import annotations

import random

from task_utils import WordBatcher, final_answer, word_tokenizer_for

NAMES = 4000  # variable identifiers v0 .. v3999
MODULUS = 10  # 100 left the sums at chance in the CPU probe (a 10,000-entry table); 10 keeps the chain of
# dependent look-ups, which is what compounds with length, and a table a small model learns in minutes
STEPS = (8, 40)  # assignments per program, inclusive
MAX_STEPS = 64  # line numbers L1 .. L64 in the vocabulary
WORDS = ("=", "+", "-", ";", "is", "trace", "answer")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
VOCAB = (*SPECIAL_TOKENS, *WORDS, *(str(n) for n in range(MODULUS)), *(f"L{i}" for i in range(1, MAX_STEPS + 1)),
         *(f"v{i}" for i in range(NAMES)))  # fmt: skip
VOCAB_SIZE = (len(VOCAB) + 127) // 128 * 128  # 4096: ids past the words stay unused


def program(rng: random.Random, steps: tuple[int, int] = STEPS, modulus: int = MODULUS):
    """A random program (the prompt) and its lines `[(name, expression words, value), ...]`. The first line assigns
    a constant; each later one a constant plus or minus an earlier variable, or the sum or difference of two."""
    k = rng.randint(*steps)
    if k > MAX_STEPS:
        raise ValueError(f"{k} lines: the vocabulary numbers lines up to {MAX_STEPS}")
    names = [f"v{i}" for i in rng.sample(range(NAMES), k)]
    values: dict[str, int] = {}
    lines = []
    for i, name in enumerate(names):
        if i == 0:
            value = rng.randrange(modulus)
            expr = [str(value)]
        elif i == 1 or rng.random() < 0.5:  # earlier variable op constant
            src, op, c = rng.choice(names[:i]), rng.choice("+-"), rng.randrange(modulus)
            value, expr = _apply(values[src], op, c, modulus), [src, op, str(c)]
        else:  # earlier variable op earlier variable
            (a, b), op = rng.sample(names[:i], 2), rng.choice("+-")
            value, expr = _apply(values[a], op, values[b], modulus), [a, op, b]
        values[name] = value
        lines.append((name, expr, value))
    prompt = " ".join(f"L{i} {name} = {' '.join(expr)} ;" for i, (name, expr, _) in enumerate(lines, 1))
    return prompt + " trace", lines


def _apply(x: int, op: str, y: int, modulus: int = MODULUS) -> int:
    return (x + y) % modulus if op == "+" else (x - y) % modulus


def written_steps(lines: list[tuple[str, list[str], int]]) -> list[tuple[str, str]]:
    """The completion's words (without the end token), each with the kind of step that writes it: `line` (the next
    line number), `copy` (from the program, or a value from a few words back), `lookup` (the value of `<name> is`,
    stated earlier), `arithmetic` (one modular sum or difference), `state` (the line's new value), `answer`, and
    `syntax` (the fixed words)."""
    values: dict[str, int] = {}
    out: list[tuple[str, str]] = []
    for i, (name, expr, value) in enumerate(lines, 1):
        out += [(f"L{i}", "line"), *((w, "copy") for w in (name, "=", *expr, ";"))]
        for w in expr[::2]:
            if w in values:
                out += [(w, "copy"), ("is", "syntax"), (str(values[w]), "lookup"), (";", "syntax")]
        if len(expr) == 3:
            a, b = (values[w] if w in values else int(w) for w in expr[::2])
            out += [(str(a), "copy"), (expr[1], "copy"), (str(b), "copy"), ("=", "syntax"), (str(value), "arithmetic"),
                    (";", "syntax")]  # fmt: skip
        out += [(name, "copy"), ("is", "syntax"), (str(value), "state"), (";", "syntax")]
        values[name] = value
    return [*out, ("answer", "syntax"), (str(lines[-1][2]), "answer")]


def completion(lines: list[tuple[str, list[str], int]]) -> str:
    """The written-out evaluation (without the end token): each line, its look-ups, its arithmetic, its value; then
    the answer."""
    return " ".join(word for word, _ in written_steps(lines))


def problems(n: int, seed: int, steps: tuple[int, int] = STEPS, modulus: int = MODULUS) -> list[tuple[str, str]]:
    """`n` (prompt, full reference completion) pairs; the answer is the completion's last word."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, lines = program(rng, steps, modulus)
        out.append((prompt, completion(lines)))
    return out


def evaluate(prompt: str, modulus: int = MODULUS) -> list[tuple[str, list[str], int]]:
    """The lines of a prompt with their values, computed from its text alone (an independent check of `program`)."""
    values: dict[str, int] = {}
    lines = []
    for line in prompt.removesuffix(" trace").split(" ;"):
        words = line.split()
        if not words:
            continue
        name, expr = words[1], words[3:]
        value = values[expr[0]] if expr[0] in values else int(expr[0])
        if len(expr) == 3:
            other = values[expr[2]] if expr[2] in values else int(expr[2])
            value = _apply(value, expr[1], other, modulus)
        values[name] = value
        lines.append((name, expr, value))
    return lines


def step_roles(prompt: str) -> list[str]:
    """The kind of step behind each completion word (`written_steps`), from the prompt alone."""
    return [role for _, role in written_steps(evaluate(prompt))]


def tokenizer():
    """A word-level fast tokenizer over `VOCAB` (whitespace split), built in memory; left padding for generation."""
    return word_tokenizer_for(VOCAB)


MODEL_KWARGS = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=2048)


def max_completion_length(steps: tuple[int, int] = STEPS) -> int:
    return 25 * steps[1] + 3  # the longest trace (at most 25 words a line), its answer and the end token


Batcher = WordBatcher
grpo_dataset, exact_answer_reward, greedy_accuracy = final_answer(problems, max_completion_length)
