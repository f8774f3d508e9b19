"""Token TIS and the mismatch statistics against values worked out by hand, and their reduction over processes."""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trl_fp8.trainer.importance_sampling import mismatch_stats, token_tis_ratio

# Two scored tokens and one padding token. delta = train - rollout = [+0.5, -1.0]; the padding token differs too,
# so a mask that is not applied shows up.
TRAIN = torch.tensor([[-1.0, -2.0, -0.5]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -3.0]])
MASK = torch.tensor([[1, 1, 0]])
E_HALF, E_MINUS_ONE = math.exp(0.5), math.exp(-1.0)  # 1.6487, 0.3679: the ratios pi_train / pi_rollout


def test_token_tis_ratio_is_train_over_rollout_clipped_and_one_on_padding():
    ratio = token_tis_ratio(TRAIN, ROLLOUT, MASK, cap=1.5)
    # pi_train / pi_rollout, not its inverse (which would give [0.61, 1.5 (e capped)]).
    assert ratio[0].tolist() == pytest.approx([1.5, E_MINUS_ONE, 1.0])
    assert token_tis_ratio(TRAIN, ROLLOUT, MASK, cap=1.5, clip_min=0.5)[0].tolist() == pytest.approx([1.5, 0.5, 1.0])
    assert token_tis_ratio(TRAIN, ROLLOUT, MASK, cap=2.0)[0].tolist() == pytest.approx([E_HALF, E_MINUS_ONE, 1.0])
    unscored = torch.tensor([[-1.5, float("nan"), -3.0]])  # a token the rollout engine did not score
    assert token_tis_ratio(TRAIN, unscored, MASK, cap=2.0)[0].tolist() == pytest.approx([E_HALF, 1.0, 1.0])


def test_mismatch_stats_match_hand_computed_values():
    stats = mismatch_stats(TRAIN, ROLLOUT, MASK, cap=1.5)
    k3 = ((E_HALF - 1 - 0.5) + (E_MINUS_ONE - 1 + 1.0)) / 2  # 0.2583; the inverted ratio would give 0.4124
    assert stats == pytest.approx(
        {
            "abs_logp_diff_mean": 0.75,
            "abs_logp_diff_max": 1.0,
            "kl_k3": k3,
            "is_ratio_mean": (E_HALF + E_MINUS_ONE) / 2,
            "is_ratio_max": E_HALF,
            "is_ratio_min": E_MINUS_ONE,
            "is_ratio_clipped_frac": 0.5,
            "pos_0_63/abs_logp_diff_mean": 0.75,  # every token sits in the first position bucket
            "pos_0_63/kl_k3": k3,
        }
    )
    assert "is_ratio_clipped_frac" not in mismatch_stats(TRAIN, ROLLOUT, MASK)
    assert mismatch_stats(TRAIN, ROLLOUT, torch.zeros_like(MASK), cap=1.5) == {}  # nothing scored: nothing logged


def _ranks(rank: int, world: int, init_file: str, out: str, with_tokens: list[bool]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    results = []
    for scenario in with_tokens:  # several calls in a row: every collective must pair up on every rank
        if rank == 0:
            train, rollout, mask = TRAIN, ROLLOUT, MASK
        else:
            train, rollout, mask = torch.tensor([[0.0]]), torch.tensor([[-2.0]]), torch.tensor([[int(scenario)]])
        results.append(mismatch_stats(train, rollout, mask, cap=1.5, gather=gather))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_mismatch_stats_reduce_over_processes_when_a_rank_has_no_tokens(tmp_path):
    out = str(tmp_path / "stats")
    mp.spawn(_ranks, args=(2, str(tmp_path / "init"), out, [False, True]), nprocs=2, join=True)
    rank0, rank1 = (json.loads(open(f"{out}.{r}").read()) for r in (0, 1))
    assert rank0 == rank1  # same keys and values everywhere
    empty_rank1, both = rank0
    assert empty_rank1 == pytest.approx(mismatch_stats(TRAIN, ROLLOUT, MASK, cap=1.5))
    # Rank 1 adds one token with delta = +2: token-weighted mean, max as a max, min as a min.
    assert both["abs_logp_diff_mean"] == pytest.approx((0.5 + 1.0 + 2.0) / 3)
    assert both["abs_logp_diff_max"] == pytest.approx(2.0)
    assert both["is_ratio_max"] == pytest.approx(math.exp(2.0)) and both["is_ratio_min"] == pytest.approx(E_MINUS_ONE)
    assert both["is_ratio_clipped_frac"] == pytest.approx(2 / 3)


def test_mismatch_is_also_reported_by_completion_position():
    """Per bucket of completion positions (0-63, 64-127, ..., 256-511, ..., 1024-2047, ...): does the mismatch grow
    along the completion?"""
    train = torch.zeros(2, 1100)
    rollout = torch.zeros(2, 1100)
    rollout[:, 10] = -0.5  # early tokens: delta +0.5
    rollout[0, 300] = 1.0  # a middle token: delta -1
    rollout[1, 1050] = -2.0  # a late token: delta +2
    mask = torch.zeros(2, 1100)
    mask[:, [10, 300]] = 1
    mask[1, 1050] = 1
    mask[1, 300] = 0  # padding in the middle bucket of the second completion
    stats = mismatch_stats(train, rollout, mask)
    assert stats["pos_0_63/abs_logp_diff_mean"] == pytest.approx(0.5)
    assert stats["pos_256_511/abs_logp_diff_mean"] == pytest.approx(1.0)
    assert stats["pos_1024_2047/abs_logp_diff_mean"] == pytest.approx(2.0)
    assert stats["pos_1024_2047/kl_k3"] == pytest.approx(math.exp(2.0) - 1 - 2.0)
    buckets = {k.split("/")[0] for k in stats if k.startswith("pos_")}
    assert buckets == {"pos_0_63", "pos_256_511", "pos_1024_2047"}  # empty buckets are not logged
    assert stats["abs_logp_diff_mean"] == pytest.approx((0.5 + 0.5 + 1.0 + 2.0) / 4)


def test_importance_sampling_ratio_in_each_of_trls_modes():
    """Per token: exp of the token's log-ratio; per sequence: exp of their sum; truncated to [clip_min, clip_max] or
    masked to 0 outside; padding and NaN rollout log-probs count as a log-ratio of 0."""
    from trl_fp8.trainer.importance_sampling import importance_sampling_ratio

    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    rollout = torch.tensor([[-1.5, -1.0, float("nan")], [-0.5, -1.2, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token_log = torch.tensor([[0.5, -1.0, 0.0], [-0.5, 0.2, 0.0]])
    seq_log = token_log.sum(-1, keepdim=True)  # [-0.5, -0.3]

    def ratio(mode, low=None, high=None):
        return importance_sampling_ratio(train, rollout, mask, mode, low, high)

    torch.testing.assert_close(ratio("token_truncate", 0.5, 1.5), token_log.exp().clamp(0.5, 1.5))
    torch.testing.assert_close(ratio("token_mask", 0.5, 1.5), torch.where(
        (token_log.exp() < 0.5) | (token_log.exp() > 1.5), 0.0, token_log.exp()))  # fmt: skip
    torch.testing.assert_close(ratio("sequence_truncate", 0.7, 3.0), seq_log.exp().clamp(0.7, 3.0))
    torch.testing.assert_close(ratio("sequence_mask", 0.7, 3.0), torch.tensor([[0.0], [math.exp(-0.3)]]))
    torch.testing.assert_close(ratio("sequence_mask", None, 3.0), seq_log.exp())
    with pytest.raises(ValueError, match="Unknown importance sampling mode 'token'"):
        ratio("token")


def test_sampling_metrics_are_trls_over_scored_tokens():
    from trl_fp8.trainer.importance_sampling import importance_sampling_ratio, sampling_metrics

    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
    rollout = torch.tensor([[-1.5, -1.0, float("nan")], [-0.5, -1.2, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ratio = importance_sampling_ratio(train, rollout, mask, "token_truncate", None, 2.0)
    got = sampling_metrics(train, rollout, mask, ratio)
    # |delta| of the scored tokens 0.5, 1.0, 0.5, 0.2 (the NaN and the padded token left out); the ratio over the
    # five completion tokens: e^0.5, e^-1, 1 (NaN: log-ratio 0), e^-0.5, e^0.2
    values = [math.exp(0.5), math.exp(-1.0), 1.0, math.exp(-0.5), math.exp(0.2)]
    assert got["sampling/sampling_logp_difference/mean"] == pytest.approx(2.2 / 4)
    assert got["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)
    assert got["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-1.0))
    assert got["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5))
    assert got["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(values) / 5)
    sequence = importance_sampling_ratio(train, rollout, mask, "sequence_truncate", None, 3.0)
    per_sequence = sampling_metrics(train, rollout, mask, sequence, per_sequence=True)
    assert per_sequence["sampling/importance_sampling_ratio/mean"] == pytest.approx(sequence.mean().item())


def test_sampling_metrics_reduce_over_processes_as_trls_scoring_pass():
    """TRL reduces `sampling/*` per process first (its mean; 0 where it has no token), then over processes: the mean
    of the means, the max of the maxima, the min of the minima. Micro-batches added up give the process's values."""
    from trl_fp8.trainer.importance_sampling import importance_sampling_ratio, sampling_metrics_of, sampling_sums

    g = torch.Generator().manual_seed(0)
    train, rollout = -torch.rand(6, 5, generator=g), -torch.rand(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    ratio = importance_sampling_ratio(train, rollout, mask, "token_truncate", None, 2.0)
    rank0 = sampling_sums(train[:2], rollout[:2], mask[:2], ratio[:2]) + sampling_sums(
        train[2:4], rollout[2:4], mask[2:4], ratio[2:4])  # two micro-batches  # fmt: skip
    rank1 = sampling_sums(train[4:], rollout[4:], mask[4:], ratio[4:])
    other = rank1

    def gather(local):  # this process is rank 0; rank 1 sends what `sampling_metrics_of` makes of `other`
        rows = []
        sampling_metrics_of(other, gather=lambda t: rows.append(t) or t)
        return torch.cat([local, rows[0]])

    got = sampling_metrics_of(rank0, gather)
    delta = (train - rollout).abs()
    per_rank = [slice(0, 4), slice(4, 6)]
    means = [delta[r][mask[r].bool()].mean().item() for r in per_rank]
    ratio_means = [ratio[r][mask[r].bool()].mean().item() for r in per_rank]
    assert got["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(means) / 2)
    assert got["sampling/sampling_logp_difference/max"] == pytest.approx(delta[mask.bool()].max().item())
    assert got["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(ratio_means) / 2)
    assert got["sampling/importance_sampling_ratio/min"] == pytest.approx(ratio[mask.bool()].min().item())
    assert got["sampling/importance_sampling_ratio/max"] == pytest.approx(ratio[mask.bool()].max().item())
    other = sampling_sums(train[4:], rollout[4:], torch.zeros_like(mask[4:]), ratio[4:])  # rank 1 scored nothing
    empty = sampling_metrics_of(rank0, gather)
    assert empty["sampling/sampling_logp_difference/mean"] == pytest.approx(means[0] / 2)  # TRL counts its 0
    assert empty["sampling/importance_sampling_ratio/min"] == 0.0  # as TRL logs it
