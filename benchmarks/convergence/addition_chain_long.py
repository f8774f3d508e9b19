"""The long-completion task at over a thousand tokens a completion: `addition_chain`'s running sum with 96 to 160
terms (completions of 860 to 1,436 words, 1,148 on average), its terms numbered up to `L160` (a 256-word vocabulary).

Pre-training draws 16 to 160 terms (`PRETRAIN_TERMS`: the short chains teach the copy and the sums, as in
`addition_chain`, the long ones the term numbers past `L96`); GRPO and the held-out set draw 96 to 160, so every
completion a study scores is at least 860 words, each one token. One wrong step makes every later sum wrong, so the
trainer-vs-rollout mismatch, the FP8 KV cache's included, has a thousand steps to compound.
"""

from __future__ import annotations

from benchmarks.convergence import addition_chain as chain
from benchmarks.convergence.task_utils import WordBatcher, final_answer, word_tokenizer_for

TERMS = (96, 160)  # terms per problem of GRPO and the held-out set, inclusive
PRETRAIN_TERMS = (16, 160)  # terms per pre-training problem
MAX_TERMS = 160
MODULUS = chain.MODULUS
VOCAB = chain.vocabulary(MAX_TERMS)
VOCAB_SIZE = (len(VOCAB) + 127) // 128 * 128  # 256
# prompts of up to 321 words and completions of up to 1,437 tokens fit 2,048 positions
MODEL_KWARGS = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=2048)
# the short task's words and roles, unchanged
terms_of, written_steps = chain.terms_of, chain.written_steps
completion, step_roles = chain.completion, chain.step_roles


def problems(n: int, seed: int, steps: tuple[int, int] = TERMS) -> list[tuple[str, str]]:
    """`n` (prompt, full reference completion) pairs of `steps[0]` to `steps[1]` terms."""
    return chain.problems(n, seed, steps, max_terms=MAX_TERMS)


def tokenizer():
    """A word-level fast tokenizer over `VOCAB` (whitespace split), built in memory."""
    return word_tokenizer_for(VOCAB)


def max_completion_length(steps: tuple[int, int] = TERMS) -> int:
    return chain.max_completion_length(steps)


Batcher = WordBatcher
grpo_dataset, exact_answer_reward, greedy_accuracy = final_answer(problems, max_completion_length)
