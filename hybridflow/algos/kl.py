"""KL divergence between the actor and the reference policy: estimators, penalty, controllers.

Per-token estimators of KL(pi || pi_ref) from samples y ~ pi, with
log r = log pi_ref(y) - log pi(y) (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html):
    k1 "kl"   = -log r = logp - ref_logp              (unbiased, high variance, can be < 0)
    "abs"     = |logp - ref_logp|
    k2 "mse"  = 0.5 (log r)^2                          (biased, low variance, >= 0)
    k3 "low_var_kl" = r - 1 - log r                    (unbiased, >= 0)
A "+" suffix (e.g. "low_var_kl+") keeps the estimator's value but takes the
gradient of k2, whose gradient is unbiased for the KL's gradient.

Departures: k3 clamps log r to [-20, 20] and its value to [-10, 10]
(numerical safety, as common practice); "full" (exact KL over the vocabulary)
is not offered because only sampled log-probs reach this code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from hybridflow.algos.core import GlobalNorm, agg_loss, masked_mean
from hybridflow.utils.registry import Registry

KLEstimatorFn = Callable[[Tensor, Tensor], Tensor]
"""(logprob, ref_logprob) -> per-token KL estimate, same shape."""

KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry(
    "KL estimator",
    "kl_type",
    "chosen by algorithm.kl_penalty and actor.kl_loss_type, optionally with a '+' suffix; "
    "add one with KL_ESTIMATORS.register",
)
"""Per-token KL estimators by name (aliases share one function)."""


@KL_ESTIMATORS.register("kl")
@KL_ESTIMATORS.register("k1")
def kl_k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k1 = -log r = logp - ref_logp."""
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """|logp - ref_logp|."""
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("mse")
@KL_ESTIMATORS.register("k2")
def kl_k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k2 = 0.5 (log r)^2."""
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("low_var_kl")
@KL_ESTIMATORS.register("k3")
def kl_k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k3 = r - 1 - log r, with log r and the value clamped (module docstring)."""
    log_r = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - 1 - log_r).clamp(-10.0, 10.0)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_type: str) -> Tensor:
    """Per-token KL estimate (module docstring) of the named type; same shape as the inputs."""
    estimate = KL_ESTIMATORS.get(kl_type.removesuffix("+"))
    value = estimate(logprob, ref_logprob)
    if not kl_type.endswith("+"):
        return value
    k2 = kl_k2(logprob, ref_logprob)
    return k2 + (value - k2).detach()


class KLController(Protocol):
    """A KL coefficient that may adapt to the measured KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """Constant coefficient beta (Ziegler et al. 2019 use it as the non-adaptive option)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_ctrl.kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """Proportional controller of beta (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences", sec. 2.2).

    e = clip(KL / KL_target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0 or target_kl <= 0 or horizon <= 0:
            raise ValueError(
                "adaptive kl_ctrl needs kl_coef >= 0, target_kl > 0, horizon > 0; "
                f"got {init_kl_coef}, {target_kl}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards the value that keeps the KL at target_kl."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def _fixed(kl_coef: float, target_kl: float | None, horizon: int | None) -> KLController:
    return FixedKLController(kl_coef)


def _adaptive(kl_coef: float, target_kl: float | None, horizon: int | None) -> KLController:
    if target_kl is None or horizon is None:
        raise ValueError("kl_ctrl.type='adaptive' needs kl_ctrl.target_kl and kl_ctrl.horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


KL_CONTROLLERS: Registry[Callable[[float, float | None, int | None], KLController]] = Registry(
    "KL controller", "algorithm.kl_ctrl.type"
)
"""Builders (kl_coef, target_kl, horizon) -> KLController by name."""
KL_CONTROLLERS.register("fixed", _fixed)
KL_CONTROLLERS.register("adaptive", _adaptive)


def get_kl_controller(
    kl_ctrl_type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """Build the controller named by algorithm.kl_ctrl.type ("fixed" or "adaptive")."""
    return KL_CONTROLLERS.get(kl_ctrl_type)(kl_coef, target_kl, horizon)


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: KLController,
    kl_type: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """KL in the reward (Ziegler et al. 2019; Ouyang et al. 2022): r_t = score_t - beta * KL_t.

    KL_t = kl_penalty(old_log_prob, ref_log_prob) on valid tokens, 0 on padding.
    The batch KL (mean over sequences of each sequence's token-mean) then
    updates `kl_ctrl` with n_steps = batch size; beta is read before the update.
    Returns (token_level_rewards, metrics).
    """
    kld = torch.where(response_mask.bool(), kl_penalty(old_log_prob, ref_log_prob, kl_type), 0.0)
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean()) if kld.shape[0] else 0.0
    kl_ctrl.update(current_kl, n_steps=kld.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def kl_loss(
    logprob: Tensor,
    ref_logprob: Tensor,
    response_mask: Tensor,
    kl_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_norm: GlobalNorm | None = None,
    norm_length: int | None = None,
) -> Tensor:
    """KL as a loss term (GRPO, Shao et al. 2024, eq. 4 uses k3): agg_loss(kl_penalty(logprob, ref_logprob)).

    The caller multiplies by its coefficient (actor.kl_loss_coef).
    """
    return agg_loss(kl_penalty(logprob, ref_logprob, kl_type), response_mask, loss_agg_mode, global_norm, norm_length)
