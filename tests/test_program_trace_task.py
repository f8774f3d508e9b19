"""The long-completion convergence task (`benchmarks/convergence/program_trace.py`): generated programs, their
written-out traces, the word-level tokenizer and the exact reward."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "convergence"))

import program_trace as task  # noqa: E402
from task_utils import answer_of  # noqa: E402


def test_traces_match_an_independent_evaluation_of_the_prompt():
    pairs = task.problems(300, seed=7)
    assert pairs == task.problems(300, seed=7) and pairs != task.problems(300, seed=8)
    for prompt, completion in pairs:
        lines = task.evaluate(prompt)
        assert completion == task.completion(lines)
        assert task.STEPS[0] <= len(lines) == prompt.count(" ;") <= task.STEPS[1]
        # a line writes itself (`L<i> <name> = <expr> ;`: 5 or 7 words), "<name> is <value> ;" per variable it reads and for its own value, and
        # "a op b = value ;" when it computes; then "answer value"
        words = sum(4 + len(expr) + 4 * sum(w.startswith("v") for w in expr) + 6 * (len(expr) == 3) + 4
                    for _, expr, _ in lines)  # fmt: skip
        assert len(completion.split()) == words + 2 <= task.max_completion_length() - 1
        assert completion.split()[-1] == str(lines[-1][2])


def test_every_written_step_is_a_copy_a_look_up_or_one_modular_operation():
    """The roles `written_steps` gives each word hold: a look-up repeats the value stated earlier for that name, an
    arithmetic step is the modular result of the two words before its `=`, line numbers count up."""
    for prompt, _ in task.problems(50, seed=5):
        steps = task.written_steps(task.evaluate(prompt))
        words = [w for w, _ in steps]
        stated, line = {}, 0
        for i, (word, role) in enumerate(steps):
            if role == "line":
                line += 1
                assert word == f"L{line}"
            elif role in ("lookup", "state"):
                name = words[i - 2]
                assert words[i - 1] == "is" and (role == "state" or stated[name] == word)
                stated[name] = word
            elif role == "arithmetic":
                a, op, b = words[i - 4 : i - 1]
                assert int(word) == (int(a) + int(b) if op == "+" else int(a) - int(b)) % task.MODULUS
            elif role == "copy":
                assert word in prompt.split() or word in words[:i]
        assert steps[-1] == (words[-1], "answer") and stated[words[-6]] == words[-1]


@pytest.mark.parametrize(
    "text, reward",
    [
        ("v1 = 3 ; v2 = 5 ; answer 5", 1.0),
        ("v1 = 3 ; v2 = 4 ; answer 4", 0.0),  # a wrong step makes the answer wrong
        ("v1 = 3 ; v2 = 5 ;", 0.0),  # no answer
        ("answer 7 ; answer 5", 1.0),  # the last answer counts
    ],
)
def test_reward_is_the_exact_final_answer(text, reward):
    assert task.exact_answer_reward([text], ["5"]) == [reward]


def test_greedy_accuracy_scores_generated_answers():
    """A stand-in model that writes a fixed completion: accuracy counts the right final answers."""
    import torch

    tok = task.tokenizer()
    pairs = task.problems(4, seed=11, steps=(2, 3))
    scripted = [tok(f" {c}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, c in pairs[:2]]

    class Scripted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, max_new_tokens, **kwargs):
            rows = [
                scripted[i % 2] + [tok.pad_token_id] * (max_new_tokens - len(scripted[i % 2]))
                for i in range(len(input_ids))
            ]
            return torch.cat([input_ids, torch.tensor(rows)], dim=1)

    # pairs 0 and 1 get their own completions (right); 2 and 3 get those of 0 and 1 (right only by chance)
    expected = sum(answer_of(scripted_c) == answer_of(c) for scripted_c, (_, c) in
                   zip([pairs[0][1], pairs[1][1]] * 2, pairs, strict=True)) / 4  # fmt: skip
    assert task.greedy_accuracy(Scripted(), tok, pairs, batch_size=4, max_new_tokens=64) == expected >= 0.5
