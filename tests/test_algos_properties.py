"""Property tests: padding invariance, group-order invariance, flat groups, global normalisation."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algos import (
    LOSS_AGG_MODES,
    GlobalNorm,
    PolicyLossConfig,
    agg_loss,
    get_advantage_estimator,
    get_policy_loss_fn,
    list_advantage_estimators,
    list_policy_losses,
)

SETTINGS = settings(max_examples=50, deadline=None)
ESTIMATORS = sorted(list_advantage_estimators())
GROUP_ESTIMATORS = ["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"]
EXTRA = {"gamma": 0.9, "lam": 0.95}


@st.composite
def batches(draw, min_len=1):
    """Integer token rewards (so sums are exact and ties common), group ids, lengths, a seed."""
    b = draw(st.integers(1, 7))
    width = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(min_len, width), min_size=b, max_size=b))
    groups = draw(st.lists(st.integers(0, 2), min_size=b, max_size=b))
    rewards = draw(st.lists(st.integers(-2, 2), min_size=b * width, max_size=b * width))
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)).long()
    rewards = torch.tensor(rewards, dtype=torch.float32).view(b, width)
    return rewards * mask, mask, np.array(groups), draw(st.integers(0, 2**31 - 1))


def side_inputs(batch, width, seed):
    gen = torch.Generator().manual_seed(seed)
    return {"values": torch.randn(batch, width, generator=gen), "reward_baselines": torch.randn(batch, generator=gen)}


def pad_with_garbage(x, mask, extra, seed):
    """Put large random numbers on every padded position and add `extra` padded columns."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.cat([x, torch.zeros(x.shape[0], extra, dtype=x.dtype)], dim=-1)
    wide_mask = torch.cat([mask, torch.zeros(mask.shape[0], extra, dtype=mask.dtype)], dim=-1)
    garbage = 1e3 * torch.randn(wide.shape, generator=gen).to(x.dtype)
    return torch.where(wide_mask.bool(), wide, garbage), wide_mask


@pytest.mark.parametrize("name", ESTIMATORS)
@SETTINGS
@given(data=batches(), extra=st.integers(1, 3))
def test_estimators_ignore_padding(name, data, extra):
    rewards, mask, groups, seed = data
    side = side_inputs(*rewards.shape, seed)
    adv, ret = get_advantage_estimator(name)(rewards, mask, groups, **side, **EXTRA)
    wide_rewards, wide_mask = pad_with_garbage(rewards, mask, extra, seed)
    wide_values, _ = pad_with_garbage(side["values"], mask, extra, seed + 1)
    side = {**side, "values": wide_values}
    wide_adv, wide_ret = get_advantage_estimator(name)(wide_rewards, wide_mask, groups, **side, **EXTRA)
    width = rewards.shape[1]
    torch.testing.assert_close(wide_adv[:, :width], adv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(wide_ret[:, :width], ret, atol=1e-4, rtol=1e-4)
    assert wide_adv[~wide_mask.bool()].eq(0).all() and wide_ret[~wide_mask.bool()].eq(0).all()


@pytest.mark.parametrize("name", ESTIMATORS)
@SETTINGS
@given(data=batches(), perm_seed=st.integers(0, 1000))
def test_estimators_do_not_depend_on_sample_order(name, data, perm_seed):
    rewards, mask, groups, seed = data
    side = side_inputs(*rewards.shape, seed)
    perm = torch.randperm(rewards.shape[0], generator=torch.Generator().manual_seed(perm_seed))
    adv, ret = get_advantage_estimator(name)(rewards, mask, groups, **side, **EXTRA)
    side_p = {k: v[perm] for k, v in side.items()}
    adv_p, ret_p = get_advantage_estimator(name)(rewards[perm], mask[perm], groups[perm.numpy()], **side_p, **EXTRA)
    torch.testing.assert_close(adv_p, adv[perm], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret_p, ret[perm], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@SETTINGS
@given(data=batches(), flat_score=st.integers(-3, 3), string_ids=st.booleans())
def test_flat_group_gives_exactly_zero_among_other_groups(name, data, flat_score, string_ids):
    rewards, mask, groups, _ = data
    flat = groups == 0  # group 0: every sample scores flat_score; groups 1, 2 keep their random rewards
    lengths = mask.sum(-1)
    rows = torch.from_numpy(np.nonzero(flat)[0])
    rewards[rows] = 0.0
    rewards[rows, lengths[rows] - 1] = float(flat_score)
    index = np.array([f"uid-{g}" for g in groups], dtype=object) if string_ids else groups
    adv, ret = get_advantage_estimator(name)(rewards, mask, index)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv[rows].eq(0).all() and ret[rows].eq(0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dp_size", [1, 2])
@SETTINGS
@given(data=batches(min_len=0), cuts=st.lists(st.integers(0, 7), max_size=4))
def test_micro_batches_with_global_norm_equal_the_global_mean(mode, dp_size, data, cuts):
    """Split rows over dp ranks and micro-batches; sum per rank, average over ranks (what FSDP does)."""
    _, mask, _, seed = data
    loss_mat = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    width = mask.shape[1]
    expected = agg_loss(loss_mat, mask, mode, norm_length=width)
    (expected_grad,) = torch.autograd.grad(expected, loss_mat)
    norm = GlobalNorm.from_mask(mask, dp_size)
    rank_rows = np.array_split(np.arange(mask.shape[0]), dp_size)
    rank_losses = []
    for rows in rank_rows:
        bounds = sorted({0, len(rows), *(c for c in cuts if c <= len(rows))})
        micro = [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        rank_losses.append(sum(agg_loss(loss_mat[r], mask[r], mode, norm, norm_length=width) for r in micro))
    total = sum(rank_losses) / dp_size
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(total, loss_mat)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(list_policy_losses()))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@settings(max_examples=15, deadline=None)
@given(data=batches(), extra=st.integers(1, 3))
def test_policy_losses_ignore_padding(name, mode, data, extra):
    _, mask, _, seed = data
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=gen) * 3
    logp = old + 0.3 * torch.randn(mask.shape, generator=gen)
    adv = torch.randn(mask.shape, generator=gen)
    # every Clip-Cov candidate is cut (no random draw), so both calls select the same tokens
    cfg = PolicyLossConfig(clip_cov_ratio=1.0, clip_cov_lb=-10.0, kl_cov_ratio=0.3, loss_norm_length=8)
    loss, stats = get_policy_loss_fn(name)(old, logp, adv, mask, loss_agg_mode=mode, config=cfg)
    wide = [pad_with_garbage(t, mask, extra, seed + i)[0] for i, t in enumerate((old, logp, adv))]
    wide_mask = pad_with_garbage(old, mask, extra, seed)[1]
    wide_loss, wide_stats = get_policy_loss_fn(name)(*wide, wide_mask, loss_agg_mode=mode, config=cfg)
    torch.testing.assert_close(wide_loss, loss, atol=1e-5, rtol=1e-5)
    for key, value in stats.items():
        torch.testing.assert_close(torch.as_tensor(wide_stats[key]), torch.as_tensor(value), atol=1e-5, rtol=1e-5)
