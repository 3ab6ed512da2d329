"""Advantage estimators against hand-computed values and plain-loop reference implementations."""

import math

import numpy as np
import pytest
import torch

from hybridflow.algos import get_advantage_estimator, list_advantage_estimators, masked_whiten, register_adv_est
from hybridflow.algos.adv_spec import ADV_ESTIMATORS


def outcome_batch(scores, lengths, width=4):
    """Token rewards with each score on the last valid token, and the matching mask."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width, dtype=torch.long)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def seq_adv(adv, mask):
    """One advantage per row, after checking it is constant over the row's valid tokens and 0 on padding."""
    out = []
    for row, m in zip(adv, mask.bool(), strict=True):
        assert row[~m].eq(0).all()
        assert torch.allclose(row[m], row[m][0].expand(int(m.sum())))
        out.append(row[m][0].item())
    return out


# groups interleaved: a = [1, 0, 0], b = [2, 2] (flat), c = [5] (singleton)
INDEX = np.array(["a", "b", "a", "c", "b", "a"], dtype=object)
SCORES = [1.0, 2.0, 0.0, 5.0, 2.0, 0.0]
LENGTHS = [1, 2, 3, 4, 2, 1]


def test_grpo_by_hand():
    r, m = outcome_batch(SCORES, LENGTHS)
    adv, ret = get_advantage_estimator("grpo")(r, m, INDEX)
    # group a: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.57735
    std = math.sqrt(1 / 3)
    assert seq_adv(adv, m) == pytest.approx([(2 / 3) / std, 0, (-1 / 3) / std, 0, 0, (-1 / 3) / std], abs=1e-5)
    assert torch.equal(adv, ret)


def test_dr_grpo_without_std_by_hand():
    r, m = outcome_batch(SCORES, LENGTHS)
    adv, _ = get_advantage_estimator("grpo")(r, m, INDEX, norm_adv_by_std_in_grpo=False)
    assert seq_adv(adv, m) == pytest.approx([2 / 3, 0, -1 / 3, 0, 0, -1 / 3], abs=1e-6)


def test_rloo_by_hand():
    r, m = outcome_batch(SCORES, LENGTHS)
    adv, _ = get_advantage_estimator("rloo")(r, m, INDEX)
    # a: 1 - (0+0)/2 = 1 ; 0 - (1+0)/2 = -0.5 ; flat b and singleton c: 0
    assert seq_adv(adv, m) == pytest.approx([1.0, 0, -0.5, 0, 0, -0.5], abs=1e-6)


def test_opo_by_hand():
    # one group, scores [1, 0], lengths [2, 4]: baseline (2*1 + 4*0) / 6 = 1/3
    r, m = outcome_batch([1.0, 0.0], [2, 4])
    adv, _ = get_advantage_estimator("opo")(r, m, np.array([7, 7]))
    assert seq_adv(adv, m) == pytest.approx([2 / 3, -1 / 3], abs=1e-6)


def test_grpo_passk_by_hand():
    # group x = [1, 0.5, 0]: only the best gets r_max - r_second = 0.5; std(1, .5, 0) = 0.5
    # group y = [1, 1, 0]: the maximum is tied, so nobody is the unique best: all 0
    r, m = outcome_batch([0.5, 1.0, 1.0, 0.0, 0.0, 1.0], [1, 2, 3, 1, 2, 3])
    index = np.array(["x", "x", "y", "x", "y", "y"], dtype=object)
    adv, _ = get_advantage_estimator("grpo_passk")(r, m, index, norm_adv_by_std_in_grpo=False)
    assert seq_adv(adv, m) == pytest.approx([0, 0.5, 0, 0, 0, 0], abs=1e-6)
    adv, _ = get_advantage_estimator("grpo_passk")(r, m, index)
    assert seq_adv(adv, m) == pytest.approx([0, 1.0, 0, 0, 0, 0], abs=1e-5)


def test_gpg_by_hand():
    # group a = [1, 0] has signal, group b = [1, 1] is flat: B = 4, M = 2, alpha = 4 / 2 = 2
    r, m = outcome_batch([1.0, 1.0, 0.0, 1.0], [1, 2, 3, 4])
    index = np.array(["a", "b", "a", "b"], dtype=object)
    adv, _ = get_advantage_estimator("gpg")(r, m, index, norm_adv_by_std_in_grpo=False)
    assert seq_adv(adv, m) == pytest.approx([1.0, 0, -1.0, 0], abs=1e-6)  # 2 * (+-0.5)
    adv, _ = get_advantage_estimator("gpg")(r, m, index)
    # std of [1, 0] is sqrt(0.5) = 0.70711 -> 2 * 0.5 / 0.70711 = 1.41421
    assert seq_adv(adv, m) == pytest.approx([math.sqrt(2), 0, -math.sqrt(2), 0], abs=1e-5)


def test_reinforce_plus_plus_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(r, m, np.array([0, 1]), gamma=0.5)
    # returns: row 0 [0.25, 0.5, 1], row 1 [0.5, 1, pad]; the 9 on padding never enters
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    # whiten the 5 valid returns: mean 0.65, squared deviations sum 0.45, unbiased var 0.1125
    std = math.sqrt(0.1125)
    expect = torch.tensor([[-0.4 / std, -0.15 / std, 0.35 / std], [-0.15 / std, 0.35 / std, 0.0]])
    torch.testing.assert_close(adv, expect, atol=1e-5, rtol=0)


def test_reinforce_plus_plus_baseline_by_hand():
    # group a = [1, 0] centred to [0.5, -0.5]; singleton b -> 0; lengths 2, 1, 1
    r, m = outcome_batch([1.0, 0.0, 3.0], [2, 1, 1], width=2)
    adv, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(r, m, np.array(["a", "a", "b"], dtype=object))
    # valid tokens [.5, .5, -.5, 0]: mean .125, squared deviations .6875, unbiased var .6875/3;
    # divided by that std only (no second mean shift), so the singleton stays 0
    std = math.sqrt(0.6875 / 3)
    expect = torch.tensor([[0.5 / std, 0.5 / std], [-0.5 / std, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(adv, expect, atol=1e-5, rtol=0)


def test_remax_by_hand():
    r = torch.tensor([[0.0, 1.0, 7.0], [0.0, 0.0, 2.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = get_advantage_estimator("remax")(r, m, np.array([0, 1]), reward_baselines=torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [1.0, 1.0, 1.0]]))


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    adv, ret = get_advantage_estimator("gae")(r, m, np.array([0]), values=v, gamma=0.9, lam=0.8)
    # delta = [0 + .9*.6 - .5, 0 + .9*.7 - .6, 1 - .7] = [.04, .03, .3]
    # A = [.04 + .72*.246, .03 + .72*.3, .3] = [.21712, .246, .3];  returns = A + V
    raw = torch.tensor([[0.21712, 0.246, 0.3]])
    torch.testing.assert_close(ret, raw + v)
    torch.testing.assert_close(adv, masked_whiten(raw, m))
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t
    _, ret1 = get_advantage_estimator("gae")(r, m, np.array([0]), values=v)
    torch.testing.assert_close(ret1, torch.ones(1, 3))


def ref_gae(rewards, values, length, gamma, lam):
    """Textbook GAE over one episode of `length` steps, as plain Python."""
    adv = [0.0] * length
    last = 0.0
    for t in reversed(range(length)):
        next_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def ref_discounted(rewards, length, gamma):
    out, running = [0.0] * length, 0.0
    for t in reversed(range(length)):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def ref_leave_one_out(scores, groups):
    out = []
    for i, (s, g) in enumerate(zip(scores, groups, strict=True)):
        others = [scores[j] for j in range(len(scores)) if groups[j] == g and j != i]
        out.append(s - sum(others) / len(others) if others else 0.0)
    return out


def random_batch(seed, batch=7, width=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen).tolist()
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)).long()
    return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen), mask, lengths


@pytest.mark.parametrize("seed", range(3))
def test_gae_and_discounted_returns_match_loops(seed):
    rewards, values, mask, lengths = random_batch(seed)
    _, ret = get_advantage_estimator("gae")(rewards, mask, np.arange(7), values=values, gamma=0.95, lam=0.9)
    _, disc = get_advantage_estimator("reinforce_plus_plus")(rewards, mask, np.arange(7), gamma=0.95)
    for i, n in enumerate(lengths):
        raw = ref_gae(rewards[i].tolist(), values[i].tolist(), n, 0.95, 0.9)
        assert (ret[i, :n] - values[i, :n]).tolist() == pytest.approx(raw, abs=1e-5)
        assert disc[i, :n].tolist() == pytest.approx(ref_discounted(rewards[i].tolist(), n, 0.95), abs=1e-5)
        assert ret[i, n:].eq(0).all() and disc[i, n:].eq(0).all()


@pytest.mark.parametrize("seed", range(3))
def test_rloo_matches_leave_one_out_loop(seed):
    rewards, _, mask, _ = random_batch(seed, batch=9)
    groups = [int(g) for g in torch.randint(0, 3, (9,), generator=torch.Generator().manual_seed(seed))]
    adv, _ = get_advantage_estimator("rloo")(rewards, mask, np.array(groups))
    scores = (rewards * mask).sum(-1).tolist()
    assert seq_adv(adv, mask) == pytest.approx(ref_leave_one_out(scores, groups), abs=1e-5)


def test_estimators_reject_missing_inputs():
    r, m = outcome_batch([1.0, 0.0], [1, 2])
    with pytest.raises(ValueError, match="'gae' needs values="):
        get_advantage_estimator("gae")(r, m, np.array([0, 0]))
    with pytest.raises(ValueError, match="'remax' needs reward_baselines="):
        get_advantage_estimator("remax")(r, m, np.array([0, 0]))
    with pytest.raises(ValueError, match="index has 3 entries but the batch has 2 rows"):
        get_advantage_estimator("grpo")(r, m, np.array([0, 0, 1]))


def test_registry_lists_looks_up_and_rejects():
    names = list_advantage_estimators()
    expected = {
        "gae",
        "grpo",
        "grpo_passk",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
        "opo",
        "gpg",
    }
    assert expected <= set(names) and names == sorted(names)
    with pytest.raises(
        ValueError,
        match="algorithm.adv_estimator='grpoo' is not a registered advantage estimator; known: .*grpo, grpo_passk",
    ):
        get_advantage_estimator("grpoo")


def test_user_registered_estimator_is_used_by_name():
    try:

        @register_adv_est("test_constant_one")
        def constant_one(token_level_rewards, response_mask, index, **unused):
            adv = response_mask.float()
            return adv, adv

        assert "test_constant_one" in list_advantage_estimators()
        r, m = outcome_batch([1.0, 0.0], [1, 2])
        adv, _ = get_advantage_estimator("test_constant_one")(r, m, np.array([0, 0]), values=None, gamma=0.9)
        assert adv.tolist() == m.float().tolist()
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("test_constant_one")(lambda *a, **k: None)
        register_adv_est("test_constant_one", override=True)(constant_one)
    finally:
        if "test_constant_one" in ADV_ESTIMATORS:
            ADV_ESTIMATORS.unregister("test_constant_one")
