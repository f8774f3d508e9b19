"""Each token's log-probability under its row of logits, with the engine's kernel forward.

vLLM's V2 sampler computes a sampled token's log-probability with one Triton program per row (max, then the sum of
exponentials in float32 over blocks of 1,024, then `logit - max - log(sum)`); the trainer calls that kernel on its
own logits of the same bits, where TRL's `selective_log_softmax` would compute another rounding of the same value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# kernel(logits [N, V], token_ids [N, 1] int64) -> [N, 1] float32 (vLLM's `compute_token_logprobs`)
TokenLogprobKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BACKWARD_ROWS = 1024  # rows of float32 softmax at a time in the backward (a 151k vocabulary: 620 MB)


def reference_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[token_ids]` in float32, called as vLLM's kernel is."""
    return logits.float().log_softmax(-1).gather(-1, token_ids)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, token_ids, kernel):
        rows = logits.reshape(-1, logits.shape[-1])
        ids = token_ids.reshape(-1, 1).to(torch.int64)
        ctx.save_for_backward(logits, token_ids)
        return kernel(rows, ids).reshape(token_ids.shape)

    @staticmethod
    def backward(ctx, grad):
        logits, token_ids = ctx.saved_tensors
        rows = logits.reshape(-1, logits.shape[-1])
        ids = token_ids.reshape(-1, 1).to(torch.int64)
        grad_rows = grad.reshape(-1, 1).float()
        grad_logits = torch.empty_like(rows)
        for start in range(0, rows.shape[0], BACKWARD_ROWS):
            part = slice(start, start + BACKWARD_ROWS)
            # d(logit_t - logsumexp)/d logits = onehot(t) - softmax
            block = -rows[part].float().softmax(-1) * grad_rows[part]
            block.scatter_add_(-1, ids[part], grad_rows[part])
            grad_logits[part] = block.to(rows.dtype)
        return grad_logits.reshape(logits.shape), None, None


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, kernel: TokenLogprobKernel = reference_token_logprobs
) -> torch.Tensor:
    """Float32 log-probabilities of `token_ids [...]` under `logits [..., V]` as `kernel` computes them; gradients
    to the logits."""
    return _TokenLogprobs.apply(logits, token_ids, kernel)
