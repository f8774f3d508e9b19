"""The long-completion convergence task: a running sum, written out term by term.

A prompt is `K` numbered digits; the completion adds them up one at a time, modulo 10, copying each term from the
prompt, writing the sum so far, and ends with the total:

    prompt:      L1 7 L2 5 L3 3 L4 9 sum
    completion:  L1 7 ; L2 5 : 7 + 5 = 2 ; L3 3 : 2 + 3 = 5 ; L4 9 : 5 + 9 = 4 ; answer 4 <eos>

Every written word is one simple operation: the next term number, the term's digit copied from the prompt (find
`L<i>` there, take the word after it), a copy of a value a few words back, or one entry of the 10 x 10 addition
table. A term costs 9 words: completions are 140 to 860 words for the default `K` of 16 to 96. One wrong step makes
every later sum wrong, so errors, and trainer-vs-rollout mismatch, compound with completion length. The reward is
exact: the final sum must be right.

Why not the first long task, tracing a program over a 4k-word vocabulary, each line looking up values stated hundreds
of words back (removed on 2026-11-25, see the changelog): a 107M model pre-trained on it for 5.5 minutes on an H200
stayed at chance, and a study needs a model that solves part of its problems first. Here the only long-range step is the
simplest copy (the word after the one just written), which is what a small transformer learns first. The vocabulary
is small (128 entries); the conversion keeps `lm_head` in BF16, so its size changes no FP8 step.
"""

from __future__ import annotations

import random

from benchmarks.convergence.task_utils import WordBatcher, final_answer, word_tokenizer_for

MODULUS = 10
TERMS = (16, 96)  # terms per problem, inclusive
MAX_TERMS = 96  # term numbers L1 .. L96 in the vocabulary
WORDS = (":", "+", "=", ";", "sum", "answer")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def vocabulary(max_terms: int) -> tuple[str, ...]:
    """The task's words with term numbers `L1 .. L<max_terms>`."""
    return (*SPECIAL_TOKENS, *WORDS, *(str(n) for n in range(MODULUS)), *(f"L{i}" for i in range(1, max_terms + 1)))


VOCAB = vocabulary(MAX_TERMS)
VOCAB_SIZE = (len(VOCAB) + 127) // 128 * 128  # 128
MODEL_KWARGS = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=2048)


def terms_of(prompt: str) -> list[int]:
    """The digits of a prompt, read from its text (`L1 7 L2 5 ... sum`)."""
    words = prompt.removesuffix(" sum").split()
    if words[::2] != [f"L{i}" for i in range(1, len(words) // 2 + 1)]:
        raise ValueError(f"not an addition-chain prompt: {prompt[:80]!r}")
    return [int(w) for w in words[1::2]]


def written_steps(terms: list[int], modulus: int = MODULUS) -> list[tuple[str, str]]:
    """The completion's words (without the end token), each with the kind of step that writes it: `line` (the next
    term number), `copy` (the term's digit, from the prompt), `operand` (a value a few words back), `arithmetic` (one
    sum modulo 10), `answer`, and `syntax` (the fixed words)."""
    total = terms[0]
    out = [("L1", "line"), (str(total), "copy"), (";", "syntax")]
    for i, term in enumerate(terms[1:], 2):
        new = (total + term) % modulus
        out += [(f"L{i}", "line"), (str(term), "copy"), (":", "syntax"), (str(total), "operand"), ("+", "syntax"),
                (str(term), "operand"), ("=", "syntax"), (str(new), "arithmetic"), (";", "syntax")]  # fmt: skip
        total = new
    return [*out, ("answer", "syntax"), (str(total), "answer")]


def completion(terms: list[int]) -> str:
    return " ".join(word for word, _ in written_steps(terms))


def problems(n: int, seed: int, steps: tuple[int, int] = TERMS, max_terms: int = MAX_TERMS) -> list[tuple[str, str]]:
    """`n` (prompt, full reference completion) pairs; `steps` bounds the number of terms, `max_terms` is the largest
    term number the vocabulary has. The answer is the completion's last word."""
    if steps[1] > max_terms:
        raise ValueError(f"{steps[1]} terms: the vocabulary numbers terms up to {max_terms}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        terms = [rng.randrange(MODULUS) for _ in range(rng.randint(*steps))]
        prompt = " ".join(f"L{i} {t}" for i, t in enumerate(terms, 1)) + " sum"
        out.append((prompt, completion(terms)))
    return out


def step_roles(prompt: str) -> list[str]:
    """The kind of step behind each completion word (`written_steps`), from the prompt alone."""
    return [role for _, role in written_steps(terms_of(prompt))]


def tokenizer():
    """A word-level fast tokenizer over `VOCAB` (whitespace split), built in memory."""
    return word_tokenizer_for(VOCAB)


def max_completion_length(steps: tuple[int, int] = TERMS) -> int:
    return 9 * steps[1]  # the longest completion (9 words a term, less 4) and the end token, with room to spare


Batcher = WordBatcher
grpo_dataset, exact_answer_reward, greedy_accuracy = final_answer(problems, max_completion_length)
