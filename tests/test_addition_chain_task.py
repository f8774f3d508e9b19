"""The long-completion convergence task (`benchmarks/convergence/addition_chain.py`): generated problems, their
written-out running sums, the word-level tokenizer and the exact reward."""

import pytest

from benchmarks.convergence import addition_chain as task


def test_completions_add_up_the_prompt_and_have_the_stated_length():
    pairs = task.problems(300, seed=7)
    assert pairs == task.problems(300, seed=7) and pairs != task.problems(300, seed=8)
    for prompt, completion in pairs:
        terms = task.terms_of(prompt)
        assert task.TERMS[0] <= len(terms) <= task.TERMS[1]
        words = completion.split()
        assert len(words) == 9 * len(terms) - 4 < task.max_completion_length()
        assert words[-2:] == ["answer", str(sum(terms) % 10)]  # the total, computed independently


def test_every_written_step_is_a_copy_or_one_sum():
    """The roles `written_steps` gives each word hold: term numbers count up, a copy is the prompt's word after that
    term number, an operand repeats a value a few words back, an arithmetic step adds the two words before its `=`."""
    for prompt, _ in task.problems(50, seed=5, steps=(2, 30)):
        prompt_words = prompt.split()
        steps = task.written_steps(task.terms_of(prompt))
        words = [w for w, _ in steps]
        line = 0
        for i, (word, role) in enumerate(steps):
            if role == "line":
                line += 1
                assert word == f"L{line}"
            elif role == "copy":
                assert word == prompt_words[prompt_words.index(words[i - 1]) + 1]
            elif role == "operand":
                assert word in words[max(0, i - 6) : i]
            elif role == "arithmetic":
                a, op, b = words[i - 4 : i - 1]
                assert op == "+" and int(word) == (int(a) + int(b)) % task.MODULUS
        assert steps[-1] == (words[-1], "answer") and words[-1] == words[-4]  # the last sum written
        assert task.step_roles(prompt) == [r for _, r in steps]


def test_every_word_is_one_token_and_the_vocabulary_is_fp8_eligible():
    """One token a word, vocabulary a multiple of 128."""
    tok = task.tokenizer()
    prompt, completion = task.problems(1, seed=3)[0]
    text = f"{prompt} {completion}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.split()) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert task.VOCAB_SIZE % 128 == 0 and len(tok) <= task.VOCAB_SIZE
    ids, labels = task.Batcher(tok)([(prompt, completion)], "cpu")
    answer_ids = labels[labels != -100].tolist()
    assert answer_ids[-1] == tok.eos_token_id and len(answer_ids) == len(completion.split()) + 1


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="not an addition-chain prompt"):
        task.terms_of("L1 7 L3 5 sum")
    with pytest.raises(ValueError, match="up to 96"):
        task.problems(1, seed=0, steps=(10, 200))


@pytest.mark.parametrize(
    "text, reward",
    [("L1 3 ; L2 2 : 3 + 2 = 5 ; answer 5", 1.0), ("L1 3 ; L2 2 : 3 + 2 = 6 ; answer 6", 0.0), ("L1 3 ;", 0.0)],
)
def test_reward_is_the_exact_final_answer(text, reward):
    assert task.exact_answer_reward([text], ["5"]) == [reward]


def test_the_long_variant_scores_completions_of_860_words_or_more_in_a_256_word_vocabulary():
    """`addition_chain_long`: GRPO and held-out problems of 96-160 terms (every completion at least 860 words, one
    token each, within the model's 2,048 positions with its prompt), pre-training problems of 16-160 terms, term
    numbers up to L160, and the same running sum and reward as the short task."""
    from benchmarks.convergence import addition_chain_long as long

    pairs = long.problems(200, seed=1)
    tok = long.tokenizer()
    for prompt, completion in pairs:
        terms = long.terms_of(prompt)
        assert long.TERMS[0] <= len(terms) <= long.TERMS[1] and len(completion.split()) >= 860
        assert completion == task.completion(terms)  # the short task's running sum, word for word
        words = len(prompt.split()) + long.max_completion_length() + 1
        assert words <= long.MODEL_KWARGS["max_position_embeddings"]
    prompt, completion = pairs[0]
    ids = tok(f"{prompt} {completion}", add_special_tokens=False)["input_ids"]
    assert len(ids) == len(f"{prompt} {completion}".split()) and tok.unk_token_id not in ids
    assert long.VOCAB_SIZE == 256 and len(tok) <= long.VOCAB_SIZE and "L160" in long.VOCAB
    short = long.problems(200, seed=2, steps=long.PRETRAIN_TERMS)
    assert min(len(long.terms_of(p)) for p, _ in short) < long.TERMS[0]  # pre-training sees the short chains too
    with pytest.raises(ValueError, match="up to 160"):
        long.problems(1, seed=0, steps=(10, 161))
    assert long.exact_answer_reward([completion], [completion.split()[-1]]) == [1.0]


def test_pretraining_draws_a_tasks_own_pretraining_lengths(monkeypatch):
    """pretrain.py asks a task with `PRETRAIN_TERMS` for problems of those lengths, and any other task for its own
    default ones."""
    from benchmarks.convergence import addition_chain_long as long
    from benchmarks.convergence import pretrain

    asked = []
    monkeypatch.setattr(long, "problems", lambda n, seed, **kw: asked.append(kw) or task.problems(n, seed, (2, 3)))
    monkeypatch.setattr(long, "greedy_accuracy", lambda *a, **k: 1.0)
    monkeypatch.setattr("sys.argv", ["pretrain", "--task", "chain_long", "--size", "smoke", "--out", "/tmp/_unused",
                                     "--max_steps", "1", "--batch_size", "2", "--eval_problems", "1"])  # fmt: skip
    monkeypatch.setattr(pretrain, "write_json", lambda *a, **k: None)
    monkeypatch.setattr("transformers.PreTrainedModel.save_pretrained", lambda *a, **k: None)
    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", lambda *a, **k: None)
    pretrain.main()
    assert asked == [{}, {"steps": long.PRETRAIN_TERMS}]  # the held-out set at GRPO's lengths, training at its own
