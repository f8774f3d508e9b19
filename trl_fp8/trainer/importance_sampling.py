"""Token-level truncated importance sampling (TIS) and trainer-vs-rollout mismatch statistics.

The ratio is TRL's own formula (`GRPOTrainer._generate_and_score_completions`, `vllm_importance_sampling_mode`), for
instance `token_truncate`'s `clamp(exp(logp_train - logp_rollout), clip_min, cap)`, with padding and unscored (NaN)
tokens at a log-ratio of 0. We compute it ourselves where TRL does not: rollouts that carry their own log-probs without
vLLM, and micro-batches that take the trainer's log-probs from their own training forward instead of TRL's scoring
pass (`FP8GRPOConfig.score_in_training_forward`). The statistics are what NeMo RL and veRL users watch, and the
`sampling/*` ones TRL logs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "importance_sampling_ratio",
    "token_tis_ratio",
    "TokenSums",
    "mismatch_sums",
    "mismatch_stats",
    "mismatch_stats_of",
    "sampling_sums",
    "sampling_metrics",
    "sampling_metrics_of",
    "POSITION_BUCKETS",
]

# TRL's `vllm_importance_sampling_mode` values, each of which `importance_sampling_ratio` computes as TRL does.
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# Completion-token positions at which mismatch is also reported per bucket: does it compound with length? Doubling
# widths from 64 tokens, so that completions of a few hundred tokens get several buckets too.
POSITION_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def importance_sampling_ratio(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None = None,
    clip_max: float | None = None,
) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio `pi_train / pi_rollout` of the sampled tokens in `mode`: per token
    (`[B, T]`) or per sequence (`[B, 1]`, from the sum of its tokens' log-ratios); `*_truncate` clamps it to
    `[clip_min, clip_max]`, `*_mask` sets it to 0 outside. A token where `mask` is 0 or the rollout log-prob is NaN
    has a log-ratio of 0."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; TRL's are {IMPORTANCE_SAMPLING_MODES}.")
    diff = torch.nan_to_num((train_logps - rollout_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def token_tis_ratio(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    clip_min: float | None = None,
) -> torch.Tensor:
    """Per-token `clamp(pi_train / pi_rollout, clip_min, cap)`; 1 where `mask` is 0 or the rollout log-prob is NaN."""
    return importance_sampling_ratio(train_logps, rollout_logps, mask, "token_truncate", clip_min, cap)


@dataclass(frozen=True)
class TokenSums:
    """One process's token counts and sums (`sums`, which add) and extremes (`maxima`, which reduce by max; a
    minimum travels negated) over some scored tokens: what a metric needs to be computed over several micro-batches
    as over their whole rollout batch. `a + b` is the statistics of both token sets."""

    sums: torch.Tensor
    maxima: torch.Tensor

    def __add__(self, other: TokenSums) -> TokenSums:
        return TokenSums(self.sums + other.sums, torch.maximum(self.maxima, other.maxima))


def _extreme(t: torch.Tensor, empty: float) -> torch.Tensor:
    return t.max() if t.numel() else t.new_tensor(empty)


def _gathered(values: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """`[processes, len(values)]` of a 1-D tensor every process sends (one collective), on the CPU."""
    return (gather(values) if gather is not None else values).reshape(-1, values.numel()).cpu()


def sampling_sums(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor,
    per_sequence: bool = False,
) -> TokenSums:
    """This process's part of TRL's `sampling/*` metrics: `|logp_train - logp_rollout|` over the scored completion
    tokens (count, sum, max) and the importance-sampling `ratio` over the completion tokens, or over the sequences for
    a per-sequence (`[B, 1]`) ratio (count, sum, max, min)."""
    valid = mask.bool()
    delta = (train_logps - rollout_logps).abs()[valid & ~torch.isnan(rollout_logps)].double()
    flat = (ratio.flatten() if per_sequence else ratio[valid]).double()
    count = delta.new_tensor
    sums = torch.stack([count(float(delta.numel())), delta.sum(), count(float(flat.numel())), flat.sum()])
    return TokenSums(sums, torch.stack([_extreme(delta, 0.0), _extreme(flat, -math.inf), _extreme(-flat, -math.inf)]))


def sampling_metrics_of(sums: TokenSums, gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """TRL's `sampling/*` metrics from each process's `sampling_sums`, reduced as TRL's scoring pass reduces them
    (`GRPOTrainer._generate_and_score_completions`): per process the mean and extremes of its tokens (0 where it has
    none), then over processes the mean of the means, the max of the maxima and the min of the minima."""
    (n_delta, sum_delta, n_ratio, sum_ratio), (max_delta, max_ratio, neg_min_ratio) = sums.sums, sums.maxima

    def per_process(n, value):
        return torch.where(n > 0, value, torch.zeros_like(value))

    local = torch.stack([per_process(n_delta, sum_delta / n_delta.clamp(min=1)), per_process(n_delta, max_delta),
                         per_process(n_ratio, -neg_min_ratio), per_process(n_ratio, sum_ratio / n_ratio.clamp(min=1)),
                         per_process(n_ratio, max_ratio)])  # fmt: skip
    rows = _gathered(local, gather)
    return {
        "sampling/sampling_logp_difference/mean": rows[:, 0].mean().item(),
        "sampling/sampling_logp_difference/max": rows[:, 1].max().item(),
        "sampling/importance_sampling_ratio/min": rows[:, 2].min().item(),
        "sampling/importance_sampling_ratio/mean": rows[:, 3].mean().item(),
        "sampling/importance_sampling_ratio/max": rows[:, 4].max().item(),
    }


def sampling_metrics(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor,
    per_sequence: bool = False,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """TRL's `sampling/*` metrics of a batch and its importance-sampling `ratio` (per token, or `[B, 1]` with
    `per_sequence`), as TRL's scoring pass computes them over every process (`sampling_metrics_of`)."""
    return sampling_metrics_of(sampling_sums(train_logps, rollout_logps, mask, ratio, per_sequence), gather)


def mismatch_sums(
    train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, cap: float | None = None
) -> TokenSums:
    """This process's part of `mismatch_stats`: token count, sums of |delta|, k3 and the ratio, tokens above `cap`,
    per-position-bucket sums, and the extremes (|delta| max, ratio max and min). A fixed shape whatever the batch
    holds, so that every process's collective pairs up."""
    valid = mask.bool() & ~torch.isnan(rollout_logps)
    delta = (train_logps - rollout_logps)[valid].double()
    ratio = delta.exp()
    abs_delta, k3 = delta.abs(), ratio - 1 - delta
    position = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)[valid]
    bounds = (*POSITION_BUCKETS, float("inf"))
    buckets = []  # tokens, sum |delta|, sum k3 per bucket
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        inside = (position >= lo) & (position < hi)
        buckets += [inside.sum().double(), abs_delta[inside].sum(), k3[inside].sum()]
    clipped = (ratio > cap).sum().double() if cap is not None else delta.new_zeros(())
    sums = torch.stack([delta.new_tensor(float(delta.numel())), abs_delta.sum(), k3.sum(), ratio.sum(), clipped,
                        *buckets])  # fmt: skip
    return TokenSums(sums, torch.stack([_extreme(abs_delta, 0.0), _extreme(ratio, 0.0), _extreme(-ratio, -math.inf)]))


def mismatch_stats_of(
    sums: TokenSums, cap: float | None = None, gather: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> dict[str, float]:
    """`mismatch_stats` from each process's `mismatch_sums`: one collective; means weighted by tokens over every
    process, maxima reduced as maxima and minima as minima; an empty dict when no process has a scored token."""
    n_sums = sums.sums.numel()
    rows = _gathered(torch.cat([sums.sums, sums.maxima]), gather)
    total, maxima = rows[:, :n_sums].sum(0), rows[:, n_sums:].amax(0)
    tokens = total[0].item()
    if tokens == 0:
        return {}
    stats = {
        "abs_logp_diff_mean": total[1].item() / tokens,
        "abs_logp_diff_max": maxima[0].item(),
        "kl_k3": total[2].item() / tokens,
        "is_ratio_mean": total[3].item() / tokens,
        "is_ratio_max": maxima[1].item(),
        "is_ratio_min": -maxima[2].item(),
    }
    if cap is not None:
        stats["is_ratio_clipped_frac"] = total[4].item() / tokens
    bounds = (*POSITION_BUCKETS, float("inf"))
    for lo, hi, (n, abs_sum, k3_sum) in zip(bounds[:-1], bounds[1:], total[5:].reshape(-1, 3).tolist(), strict=True):
        if n:
            name = f"pos_{lo}_{'inf' if hi == float('inf') else int(hi) - 1}"
            stats[f"{name}/abs_logp_diff_mean"] = abs_sum / n
            stats[f"{name}/kl_k3"] = k3_sum / n
    return stats


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

    `gather` (e.g. `accelerator.gather`) concatenates a 1-D tensor over processes (`mismatch_stats_of`).
    """
    return mismatch_stats_of(mismatch_sums(train_logps, rollout_logps, mask, cap), cap, gather)
