"""Token-level truncated importance sampling (TIS) and trainer-vs-rollout mismatch statistics.

The ratio is TRL's own `token_truncate` formula, `clamp(exp(logp_train - logp_rollout), clip_min, cap)`, with
padding and unscored (NaN) tokens at exactly 1; we compute it ourselves only where TRL does not (rollouts that
carry their own log-probs without vLLM). The statistics are what NeMo RL and veRL users watch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["token_tis_ratio", "mismatch_stats", "POSITION_BUCKETS"]

# Completion-token positions at which mismatch is also reported per bucket: does it compound with length? Doubling
# widths from 64 tokens, so that completions of a few hundred tokens get several buckets too.
POSITION_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_tis_ratio(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    clip_min: float | None = None,
) -> torch.Tensor:
    """Per-token `clamp(pi_train / pi_rollout, clip_min, cap)`; 1 where `mask` is 0 or the rollout log-prob is NaN."""
    diff = torch.nan_to_num((train_logps - rollout_logps) * mask, nan=0.0)
    return torch.clamp(torch.exp(diff), min=clip_min, max=cap)


def mismatch_stats(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Trainer-vs-rollout mismatch over the completion tokens of every process.

    Returns `abs_logp_diff_mean`, `abs_logp_diff_max`, `kl_k3` (KL(pi_rollout || pi_train), Schulman's k3
    `r - 1 - log r` with `r = pi_train / pi_rollout`, averaged over tokens sampled from the rollout policy),
    `is_ratio_mean|max|min` and, with `cap`, `is_ratio_clipped_frac`; an empty dict when no process has a scored token.
    For `[batch, completion position]` inputs, also `pos_<lo>_<hi>/abs_logp_diff_mean` and `pos_<lo>_<hi>/kl_k3` per
    bucket of completion positions (`POSITION_BUCKETS`) that holds tokens.

    `gather` (e.g. `accelerator.gather`) concatenates a 1-D tensor over processes. Every process sends one tensor of
    the same shape whatever its batch holds (token-weighted sums and extremes), so the collectives always pair up,
    means are weighted by tokens, maxima reduce as maxima and minima as minima.
    """
    valid = mask.bool() & ~torch.isnan(rollout_logps)
    delta = (train_logps - rollout_logps)[valid].double()
    ratio = delta.exp()
    abs_delta, k3 = delta.abs(), ratio - 1 - delta
    position = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)[valid]
    bounds = (*POSITION_BUCKETS, float("inf"))
    buckets = []  # tokens, sum |delta|, sum k3 per bucket: a fixed shape on every process
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        inside = (position >= lo) & (position < hi)
        buckets += [inside.sum().double(), abs_delta[inside].sum(), k3[inside].sum()]

    def extreme(t: torch.Tensor, empty: float) -> torch.Tensor:
        return t.max() if t.numel() else t.new_tensor(empty)

    # Sums first, then maxima (the minimum ratio travels negated so that every extreme reduces with max).
    local = torch.stack(
        [
            delta.new_tensor(float(delta.numel())),
            abs_delta.sum(),
            k3.sum(),
            ratio.sum(),
            (ratio > cap).sum().double() if cap is not None else delta.new_zeros(()),
            extreme(abs_delta, 0.0),
            extreme(ratio, 0.0),
            extreme(-ratio, float("-inf")),
            *buckets,
        ]
    )
    rows = (gather(local) if gather is not None else local).reshape(-1, local.numel()).cpu()
    sums, maxima, bucket_sums = rows[:, :5].sum(0), rows[:, 5:8].amax(0), rows[:, 8:].sum(0).reshape(-1, 3)
    tokens = sums[0].item()
    if tokens == 0:
        return {}
    stats = {
        "abs_logp_diff_mean": sums[1].item() / tokens,
        "abs_logp_diff_max": maxima[0].item(),
        "kl_k3": sums[2].item() / tokens,
        "is_ratio_mean": sums[3].item() / tokens,
        "is_ratio_max": maxima[1].item(),
        "is_ratio_min": -maxima[2].item(),
    }
    if cap is not None:
        stats["is_ratio_clipped_frac"] = sums[4].item() / tokens
    for lo, hi, (n, abs_sum, k3_sum) in zip(bounds[:-1], bounds[1:], bucket_sums.tolist(), strict=True):
        if n:
            name = f"pos_{lo}_{'inf' if hi == float('inf') else int(hi) - 1}"
            stats[f"{name}/abs_logp_diff_mean"] = abs_sum / n
            stats[f"{name}/kl_k3"] = k3_sum / n
    return stats
