"""What the convergence task modules share: the supervised batch layout and greedy generation for held-out accuracy
(all of them), and for the word-level long-completion tasks (`addition_chain.py`) the tokenizer,
the batcher and the final-answer reward, dataset and accuracy."""

from __future__ import annotations


def right_padded(rows: list[tuple[list[int], list[int]]], pad: int, device):
    """`(ids, labels)` from `(prompt ids, answer ids)` rows, right padded; labels cover the answer ids only."""
    import torch

    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.tensor([p + a + [pad] * (width - len(p) - len(a)) for p, a in rows])
    labels = torch.tensor([[-100] * len(p) + a + [-100] * (width - len(p) - len(a)) for p, a in rows])
    return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def greedy_completions(model, tokenizer, prompts: list[str], batch_size: int, max_new_tokens: int) -> list[str]:
    """The model's greedy completion of each prompt (its own forward, FP8 or not), decoded without special tokens."""
    import torch

    was_training = model.training
    model.eval()
    texts = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(
                prompts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return texts


def word_tokenizer_for(vocab):
    """A word-level fast tokenizer over `vocab` (whitespace split; `<pad>`, `<eos>`, `<unk>` among its words)."""
    from trl_fp8.demo.tiny_model import word_tokenizer

    return word_tokenizer(vocab, pad="<pad>", eos="<eos>", unk="<unk>")


class WordBatcher:
    """prompt + reference completion + <eos>, right padded; the loss covers the completion and the end token."""

    def __init__(self, tok):
        self.ids = tok.get_vocab()
        self.eos, self.pad = tok.eos_token_id, tok.pad_token_id

    def words(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]

    def __call__(self, pairs, device):
        return right_padded([(self.words(q), self.words(a) + [self.eos]) for q, a in pairs], self.pad, device)


def answer_of(text: str) -> str | None:
    """The value after the last `answer` in a completion, or None when there is none."""
    words = text.split()
    for i in range(len(words) - 2, -1, -1):
        if words[i] == "answer":
            return words[i + 1]
    return None


def final_answer(problems, max_completion_length):
    """`(grpo_dataset, exact_answer_reward, greedy_accuracy)` of a word-level task whose completions end in
    `answer <value>`, from its `problems(n, seed)` and `max_completion_length()`."""

    def grpo_dataset(n: int, seed: int):
        """`datasets.Dataset` of plain-text prompts and the `answer` column the reward reads."""
        from datasets import Dataset

        pairs = problems(n, seed)
        return Dataset.from_dict({"prompt": [q for q, _ in pairs], "answer": [answer_of(a) for _, a in pairs]})

    def exact_answer_reward(completions, answer, **kwargs) -> list[float]:
        """1.0 when the completion's final `answer` value is right, else 0.0 (TRL reward fn)."""
        return [float(answer_of(c) == a) for c, a in zip(completions, answer, strict=True)]

    def greedy_accuracy(model, tok, pairs, batch_size: int = 256, max_new_tokens: int | None = None) -> float:
        """Fraction of `pairs` whose greedy completion ends with the right answer (the model's own forward; large
        batches, since a batch decodes for as long as its longest completion)."""
        texts = greedy_completions(
            model, tok, [q for q, _ in pairs], batch_size, max_new_tokens or max_completion_length()
        )
        return sum(answer_of(t) == answer_of(a) for t, (_, a) in zip(texts, pairs, strict=True)) / len(pairs)

    return grpo_dataset, exact_answer_reward, greedy_accuracy
