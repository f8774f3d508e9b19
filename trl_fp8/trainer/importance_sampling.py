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

import torch

__all__ = [
    "IMPORTANCE_SAMPLING_MODES",
    "importance_sampling_ratio",
    "token_tis_ratio",
    "mismatch_stats",
    "sampling_metrics",
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


def sampling_metrics(
    train_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor,
    per_sequence: bool = False,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """TRL's `sampling/*` metrics of a batch and its importance-sampling `ratio` (per token, or `[B, 1]` with
    `per_sequence`): `|logp_train - logp_rollout|` over the scored completion tokens (mean, max) and the ratio (min, mean,
    max), over every process with one `gather`; means weighted by tokens (sequences for a per-sequence ratio)."""
    valid = mask.bool()
    delta = (train_logps - rollout_logps).abs()[valid & ~torch.isnan(rollout_logps)].double()
    flat = (ratio.flatten() if per_sequence else ratio[valid]).double()

    def extreme(t: torch.Tensor) -> torch.Tensor:
        return t.max() if t.numel() else t.new_tensor(-math.inf)

    local = torch.stack([delta.new_tensor(float(delta.numel())), delta.sum(), extreme(delta),
                         delta.new_tensor(float(flat.numel())), flat.sum(), extreme(flat), extreme(-flat)])  # fmt: skip
    rows = (gather(local) if gather is not None else local).reshape(-1, local.numel()).cpu()
    sums, maxima = rows[:, [0, 1, 3, 4]].sum(0), rows[:, [2, 5, 6]].amax(0)
    out = {}
    if sums[0] > 0:
        out["sampling/sampling_logp_difference/mean"] = (sums[1] / sums[0]).item()
        out["sampling/sampling_logp_difference/max"] = maxima[0].item()
    if sums[2] > 0:
        out["sampling/importance_sampling_ratio/min"] = -maxima[2].item()
        out["sampling/importance_sampling_ratio/mean"] = (sums[3] / sums[2]).item()
        out["sampling/importance_sampling_ratio/max"] = maxima[1].item()
    return out


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
