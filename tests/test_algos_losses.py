"""Policy and value losses against hand-computed values and gradients."""

import math

import pytest
import torch

from hybridflow.algos import (
    PolicyLossConfig,
    compute_value_loss,
    get_policy_loss_fn,
    list_policy_losses,
    register_policy_loss,
)
from hybridflow.algos import losses as loss_mod


def run(name, ratios, adv, mask=None, old=None, **kw):
    """Loss, stats and d loss / d log_prob for per-token ratios r = exp(logp - logp_old)."""
    old = torch.zeros(1, len(ratios)) if old is None else old
    logp = (old + torch.log(torch.tensor([ratios]))).requires_grad_()
    mask = torch.ones(1, len(ratios)) if mask is None else mask
    loss, stats = get_policy_loss_fn(name)(old, logp, torch.tensor([adv]), mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), {k: float(v) for k, v in stats.items()}, grad[0].tolist()


def test_vanilla_clip_and_dual_clip_by_hand():
    loss, stats, grad = run("vanilla", [1.5, 0.5, 1.1, 4.0], [1.0, 1.0, -1.0, -1.0], config=PolicyLossConfig())
    # r=1.5, A=1:  max(-1.5, -1.2) = -1.2 (clipped)      r=0.5, A=1:  max(-0.5, -0.8) = -0.5
    # r=1.1, A=-1: max(1.1, 1.1) = 1.1, min(., 3) = 1.1   r=4, A=-1: max(4, 1.2) = 4 -> dual clip min(4, 3) = 3
    assert loss == pytest.approx((-1.2 - 0.5 + 1.1 + 3.0) / 4)
    assert stats["pg_clipfrac"] == 0.25 and stats["pg_clipfrac_lower"] == 0.25
    assert stats["ppo_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 1.1 * 4.0) / 4)
    # d/dlogp of -A r is -A r where unclipped; clipped and dual-clipped tokens get 0
    assert grad == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])


def test_vanilla_asymmetric_clip_by_hand():
    cfg = PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.28)
    loss, stats, _ = run("vanilla", [1.5, 0.85], [1.0, -1.0], config=cfg)
    # r=1.5, A=1 -> -min(1.5, 1.28) = -1.28 ; r=0.85, A=-1 -> max(0.85, 0.9) = 0.9
    assert loss == pytest.approx((-1.28 + 0.9) / 2)
    assert stats["pg_clipfrac"] == 1.0


def test_gspo_sequence_ratio_by_hand():
    # log-ratios 0.1 and 0.3 -> sequence ratio exp(0.2) = 1.2214 > 1 + 4e-4: clipped, loss -(1 + 4e-4)
    loss, stats, grad = run("gspo", [math.exp(0.1), math.exp(0.3)], [1.0, 1.0], config=PolicyLossConfig())
    assert loss == pytest.approx(-1.0004) and stats["pg_clipfrac"] == 1.0 and grad == [0.0, 0.0]
    # log-ratios +-1e-4 -> s = 1 exactly inside the band: loss -A s = -1, grad of each token -A s / 2
    loss, stats, grad = run("gspo", [math.exp(1e-4), math.exp(-1e-4)], [1.0, 1.0])
    assert loss == pytest.approx(-1.0, abs=1e-6) and stats["pg_clipfrac"] == 0.0
    assert grad == pytest.approx([-0.5, -0.5], abs=1e-6)


def test_gspo_ratio_is_per_sequence_and_ignores_padding():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.2, 0.0, 9.0], [0.0, 0.0, 0.0]])  # row 0: mean over 2 valid tokens 0.1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    cfg = PolicyLossConfig(gspo_clip_ratio_low=1.0, gspo_clip_ratio_high=1.0)  # no clipping
    loss, _ = get_policy_loss_fn("gspo")(
        old, logp, torch.ones(2, 3), mask, loss_agg_mode="seq-mean-token-mean", config=cfg
    )
    assert loss.item() == pytest.approx(-(math.exp(0.1) + 1.0) / 2)


def test_gpg_by_hand():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = get_policy_loss_fn("gpg")(old, logp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    # -A logp = [1, -2] -> mean -0.5 ; gradient -A / 2
    assert loss.item() == pytest.approx(-0.5)
    assert torch.autograd.grad(loss, logp)[0].tolist() == [[-0.5, 0.5]]


def test_cispo_by_hand():
    # default weight clip [0, 1.28]: w = [1.28, 0.5, 1.0]; value -A w, gradient -A w / 3
    loss, stats, grad = run("cispo", [1.5, 0.5, 1.0], [1.0, 1.0, -1.0])
    assert loss == pytest.approx((-1.28 - 0.5 + 1.0) / 3)
    assert grad == pytest.approx([-1.28 / 3, -0.5 / 3, 1.0 / 3])
    assert stats["pg_clipfrac"] == pytest.approx(1 / 3)


def test_sapo_by_hand():
    # on-policy (r = 1): f = 4/tau * sigmoid(0) = 2/tau; tau_pos = 1 for A > 0, tau_neg = 1.05 for A < 0
    loss, stats, grad = run("sapo", [1.0, 1.0], [1.0, -1.0])
    assert loss == pytest.approx((-2.0 + 2.0 / 1.05) / 2, abs=1e-6)
    # gate slope 4 sigma (1 - sigma) = 1 at r = 1, so the gradient is plain policy gradient -A / 2
    assert grad == pytest.approx([-0.5, 0.5]) and stats["pg_clipfrac"] == 0.0
    # r = e^0.5 = 1.64872, A = 1: sigmoid(0.64872) = 0.65672 -> loss -4 * 0.65672 = -2.62689
    loss, _, _ = run("sapo", [math.exp(0.5)], [1.0])
    assert loss == pytest.approx(-2.62689, abs=1e-4)


# covariance fixture: A = [2, -2, 0, 0] (mean 0), logp = [-1, -3.5, -2, -1.5] (mean -2)
# Cov = A * (logp + 2) = [2 * 1, -2 * -1.5, 0, 0] = [2, 3, 0, 0]
COV_ADV = torch.tensor([[2.0, -2.0, 0.0, 0.0]])
COV_LOGP = torch.tensor([[-1.0, -3.5, -2.0, -1.5]])


def test_clip_cov_cuts_high_covariance_tokens():
    logp = COV_LOGP.clone().requires_grad_()
    cfg = PolicyLossConfig(clip_cov_ratio=0.5)  # k = 2 of 4 tokens; both candidates (1 < cov < 5) are cut
    loss, stats = get_policy_loss_fn("clip_cov")(COV_LOGP, logp, COV_ADV, torch.ones(1, 4), config=cfg)
    assert loss.item() == 0.0 and float(stats["pg_covclipfrac"]) == 0.5
    assert torch.autograd.grad(loss, logp)[0].tolist() == [[0.0, 0.0, 0.0, 0.0]]
    cfg = PolicyLossConfig(clip_cov_ratio=0.25)  # k = 1: one of the two, at random
    loss, stats = get_policy_loss_fn("clip_cov")(COV_LOGP, COV_LOGP, COV_ADV, torch.ones(1, 4), config=cfg)
    # token 0 alone: -2 / 4 ; token 1 alone: +2 / 4 ; whichever survives
    assert abs(loss.item()) == pytest.approx(0.5) and float(stats["pg_covclipfrac"]) == 0.25


def test_kl_cov_penalises_top_covariance_token():
    old = COV_LOGP - torch.tensor([[0.1, 0.2, 0.0, 0.0]])  # log r = [.1, .2, 0, 0]
    cfg = PolicyLossConfig(kl_cov_ratio=0.25, ppo_kl_coef=0.1)  # k = 1: token 1 (Cov 3)
    loss, stats = get_policy_loss_fn("kl_cov")(old, COV_LOGP, COV_ADV, torch.ones(1, 4), config=cfg)
    # -A r = [-2 e^.1, 2 e^.2, 0, 0] = [-2.21034, 2.44281, 0, 0]; + 0.1 * |0.2| on token 1
    assert loss.item() == pytest.approx((-2.21034 + 2.44281 + 0.02) / 4, abs=1e-5)
    assert float(stats["pg_klcovfrac"]) == 0.25


def test_truncated_importance_sampling_weights():
    old = torch.tensor([[math.log(3.0), 0.0]])
    rollout = torch.zeros(1, 2)  # exp(old - rollout) = [3, 1] -> capped at 2: weights [2, 1]
    logp = old.clone().requires_grad_()
    cfg = PolicyLossConfig(tis_imp_ratio_cap=2.0)
    loss, _ = get_policy_loss_fn("vanilla")(
        old, logp, torch.ones(1, 2), torch.ones(1, 2), config=cfg, rollout_log_probs=rollout
    )
    assert loss.item() == pytest.approx((-2.0 - 1.0) / 2)
    with pytest.raises(ValueError, match="tis_imp_ratio_cap is set but rollout_log_probs is None"):
        get_policy_loss_fn("vanilla")(old, logp, torch.ones(1, 2), torch.ones(1, 2), config=cfg)


def test_every_loss_ignores_nan_padding_in_value():
    old = torch.tensor([[0.0, 0.0, float("nan")]])
    logp = torch.tensor([[0.1, -0.1, float("nan")]])
    adv = torch.tensor([[1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    for name in list_policy_losses():
        loss, stats = get_policy_loss_fn(name)(old, logp, adv, mask)
        assert torch.isfinite(loss), name
        assert all(math.isfinite(float(v)) for v in stats.values()), name


def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 2.0]])
    values = torch.tensor([[0.5, 2.0]])
    returns = torch.tensor([[2.0, 1.0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=0.2)
    # token 0: (1-2)^2 = 1 vs clipped (0.7-2)^2 = 1.69 -> 1.69 ; token 1: 1 vs 1 -> 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert clipfrac.item() == 0.5
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(vpreds, returns, values, torch.ones(1, 2), cliprange_value=0.0)


def test_policy_loss_config_rejects_bad_combinations():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_cov_lb .* clip_cov_ub"):
        PolicyLossConfig(clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        PolicyLossConfig(clip_ratio_low=1.5)
    assert (PolicyLossConfig(clip_ratio=0.3).low, PolicyLossConfig(clip_ratio_high=0.28).high) == (0.3, 0.28)


def test_registry_lists_looks_up_and_rejects():
    names = list_policy_losses()
    assert {"vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo"} <= set(names)
    with pytest.raises(
        ValueError, match="actor.policy_loss_mode='ppo' is not a registered policy loss; known: cispo, clip_cov"
    ):
        get_policy_loss_fn("ppo")


def test_user_registered_loss_is_used_by_name():
    try:

        @register_policy_loss("test_reinforce")
        def reinforce(old_log_prob, log_prob, advantages, response_mask, *, config=None, **kw):
            return loss_mod.finish_policy_loss(
                -advantages * log_prob,
                old_log_prob,
                log_prob,
                response_mask,
                kw.get("loss_agg_mode", "token-mean"),
                config or PolicyLossConfig(),
                None,
                None,
                {"pg_clipfrac": torch.zeros(())},
            )

        loss, stats, _ = run("test_reinforce", [1.0, 1.0], [1.0, 3.0], config=PolicyLossConfig())
        assert loss == 0.0 and set(stats) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_reinforce")(lambda *a, **k: None)
    finally:
        if "test_reinforce" in loss_mod.POLICY_LOSSES:
            loss_mod.POLICY_LOSSES.unregister("test_reinforce")


def test_a_math_loss_is_registered_with_the_shared_steps_and_its_shape_is_checked():
    try:

        @loss_mod.policy_loss("test_math_reinforce")
        def reinforce(x):
            return -x.advantages * x.log_prob, {"n_valid": x.response_mask.sum()}

        loss, stats, grad = run("test_math_reinforce", [1.0, 1.0], [1.0, 3.0], loss_agg_mode="seq-mean-token-sum")
        assert loss == 0.0 and grad == [-1.0, -3.0]  # -A log pi summed over the row's tokens: -A per token
        assert stats == {"pg_clipfrac_lower": 0.0, "pg_clipfrac": 0.0, "n_valid": 2.0, "ppo_kl": 0.0}
        assert get_policy_loss_fn("test_math_reinforce") is reinforce and reinforce.__name__ == "reinforce"

        @loss_mod.policy_loss("test_math_scalar")
        def scalar(x):
            return (-x.advantages * x.log_prob).mean()

        with pytest.raises(
            ValueError,
            match=r"policy_loss_mode='test_math_scalar': its math returned a loss of shape \(\); .* shape \(1, 2\)",
        ):
            run("test_math_scalar", [1.0, 1.0], [1.0, 3.0])
    finally:
        for name in ("test_math_reinforce", "test_math_scalar"):
            if name in loss_mod.POLICY_LOSSES:
                loss_mod.POLICY_LOSSES.unregister(name)
