"""Token-level truncated importance sampling (TIS) and trainer-vs-rollout mismatch statistics.

The ratio is TRL's own `token_truncate` formula, `clamp(exp(logp_train - logp_rollout), clip_min, cap)`, with
padding and unscored (NaN) tokens at exactly 1; we compute it ourselves only where TRL does not (rollouts that
carry their own log-probs without vLLM). The statistics are what NeMo RL and veRL users watch.
"""

from __future__ import annotations

import torch

__all__ = ["token_tis_ratio", "mismatch_stats"]


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
    train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor, cap: float | None = None
) -> dict[str, torch.Tensor]:
    """Mean and max |delta logp|, the KL(rollout || train) k3 estimate, and the raw IS ratio's spread, over the
    completion tokens (0-d tensors, so callers can gather them across processes).

    k3 = r - 1 - log r with r = pi_train / pi_rollout, on tokens sampled from the rollout policy: an unbiased,
    non-negative estimate of KL(pi_rollout || pi_train) (Schulman's k3).
    """
    valid = mask.bool() & ~torch.isnan(rollout_logps)
    delta = (train_logps - rollout_logps)[valid]
    if delta.numel() == 0:
        zero = train_logps.new_zeros(())
        return {"abs_logp_diff_mean": zero, "abs_logp_diff_max": zero, "kl_k3": zero, "is_ratio_mean": zero + 1}
    ratio = torch.exp(delta)
    stats = {
        "abs_logp_diff_mean": delta.abs().mean(),
        "abs_logp_diff_max": delta.abs().max(),
        "kl_k3": (ratio - 1 - delta).mean(),
        "is_ratio_mean": ratio.mean(),
        "is_ratio_max": ratio.max(),
        "is_ratio_min": ratio.min(),
    }
    if cap is not None:
        stats["is_ratio_clipped_frac"] = (ratio > cap).float().mean()
    return stats
