"""What the convergence task modules (`arithmetic.py`, `program_trace.py`) share: the supervised batch layout and
greedy generation for held-out accuracy."""

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
