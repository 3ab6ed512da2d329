"""KL estimators, KL-in-reward, KL loss and the KL controllers, by hand."""

import math

import pytest
import torch

from hybridflow.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_loss,
    kl_penalty,
)

LOGP = torch.tensor([math.log(0.5)])
REF = torch.tensor([math.log(0.25)])
LOG2 = math.log(2.0)  # logp - ref = log 2 = 0.693147


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("kl", LOG2),  # k1 = logp - ref
        ("k1", LOG2),
        ("abs", LOG2),
        ("mse", 0.5 * LOG2**2),  # k2 = 0.240227
        ("k2", 0.5 * LOG2**2),
        ("low_var_kl", 0.5 - 1 + LOG2),  # k3: r = ref/p = 0.5 -> 0.5 - 1 - log 0.5 = 0.193147
        ("k3", 0.5 - 1 + LOG2),
    ],
)
def test_kl_estimators_by_hand(kl_type, expected):
    assert kl_penalty(LOGP, REF, kl_type).item() == pytest.approx(expected, rel=1e-6)


def test_k1_can_be_negative_abs_cannot():
    assert kl_penalty(REF, LOGP, "kl").item() == pytest.approx(-LOG2)
    assert kl_penalty(REF, LOGP, "abs").item() == pytest.approx(LOG2)


def test_low_var_kl_is_clamped():
    # logp - ref = -30: k3 = e^20 - 1 - 20 after the log-ratio clamp, then clamped to 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0


def test_straight_through_suffix_keeps_value_takes_k2_gradient():
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    out = kl_penalty(logp, REF, "low_var_kl+")
    assert out.item() == pytest.approx(0.5 - 1 + LOG2, rel=1e-6)
    # d/dlogp of 0.5 (logp - ref)^2 = logp - ref = log 2
    assert torch.autograd.grad(out.sum(), logp)[0].item() == pytest.approx(LOG2, rel=1e-6)


def test_unknown_kl_type_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match="kl_type='full' is not a registered KL estimator; known: abs, k1, k2, k3, kl, low_var_kl, mse"
    ):
        kl_penalty(LOGP, REF, "full")


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    old = torch.zeros(2, 2)
    ref = torch.tensor([[-0.1, -0.2], [-0.3, 9.0]])  # k1 = old - ref = [[.1, .2], [.3, pad]]
    ctrl = FixedKLController(0.5)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.9], [-0.15, 2.0]]))
    # batch KL: mean over sequences of token means = (0.15 + 0.3) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.225)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5


def test_apply_kl_penalty_updates_adaptive_controller():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    mask = torch.ones(4, 3)
    old = torch.zeros(4, 3)
    _, metrics = apply_kl_penalty(torch.zeros(4, 3), old, old - 1.0, mask, ctrl, "kl")  # KL = 1 >> target
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # coefficient used, read before the update
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 4 / 100))


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 9/6 - 1 = 0.5 -> clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=5.4, n_steps=100)  # error -0.1, inside the clip
    assert ctrl.value == pytest.approx(0.1 * (1 - 0.1 * 100 / 10000))
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 10)
    assert fixed.value == 0.3


def test_get_kl_controller():
    assert isinstance(get_kl_controller("fixed", 0.1), FixedKLController)
    ctrl = get_kl_controller("adaptive", 0.1, target_kl=6.0, horizon=10000)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.1
    with pytest.raises(ValueError, match="needs kl_ctrl.target_kl and kl_ctrl.horizon"):
        get_kl_controller("adaptive", 0.1)
    with pytest.raises(
        ValueError, match="algorithm.kl_ctrl.type='pid' is not a registered KL controller; known: adaptive, fixed"
    ):
        get_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        get_kl_controller("fixed", -1.0)


def test_kl_loss_aggregates_per_token_estimates():
    logp = torch.tensor([[math.log(0.5), 0.0, 5.0]])
    ref = torch.tensor([[math.log(0.25), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # k3 per valid token: [0.193147, 0]; token-mean over 2 tokens
    assert kl_loss(logp, ref, mask, "low_var_kl").item() == pytest.approx((0.5 - 1 + LOG2) / 2, rel=1e-6)
    assert kl_loss(logp, ref, mask, "kl", "seq-mean-token-sum").item() == pytest.approx(LOG2, rel=1e-6)
