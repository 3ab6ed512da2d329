"""Rollout importance sampling: correct for the sampler not being the policy that is trained.

The rollout draws tokens from pi_rollout (another engine, another dtype, or, with
trainer.mode=one_step_off/async, weights up to trainer.max_staleness updates old);
the PPO ratio is taken against pi_old, the trainer's own log-probs before the update.
Weighting each token's loss by

    rho = pi_old(y) / pi_rollout(y) = exp(old_log_prob - rollout_log_prob)

makes the gradient an unbiased estimate under pi_old again; bounding rho keeps its
variance finite (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; Espeholt et al. 2018 for truncated IS in IMPALA).

Config (verl's names): algorithm.rollout_is_threshold (upper bound; None: off),
rollout_is_threshold_lower (None: 1 / upper), rollout_is_level (registry
ROLLOUT_IS_LEVELS: "token" rho per token, "sequence" the product over the response),
rollout_is_mode (registry ROLLOUT_IS_MODES: "truncate" min(rho, upper), "mask" rho
inside [lower, upper] and 0 outside), algorithm.rollout_is (apply the weights to the
loss; False: only log the metrics).

Departures:
- "mask" gives dropped tokens weight 0; they still count in the token-mean's
  denominator (verl removes them from the response mask), so masking shrinks the
  step instead of renormalising over the kept tokens.
- The log-ratio is clamped to [-20, 20] before exp, as in the policy losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybridflow.algos.core import masked_mean, masked_sum
from hybridflow.utils.registry import Registry

LOG_RATIO_CLAMP = 20.0

LevelFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(old_log_prob [B, R], rollout_log_prob [B, R], response_mask [B, R]) -> log rho [B, R]."""
ModeFn = Callable[[Tensor, float, float], tuple[Tensor, Tensor]]
"""(rho [B, R], lower, upper) -> (weights [B, R], kept [B, R] bool)."""

ROLLOUT_IS_LEVELS: Registry[LevelFn] = Registry("rollout IS level", "algorithm.rollout_is_level")
"""How rho is aggregated: per token or per sequence."""
ROLLOUT_IS_MODES: Registry[ModeFn] = Registry("rollout IS mode", "algorithm.rollout_is_mode")
"""How rho is bounded: truncated or masked."""


@ROLLOUT_IS_LEVELS.register("token")
def token_log_ratio(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """log rho_t = old_t - rollout_t for every valid token; 0 on padding."""
    diff = (old_log_prob - rollout_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(response_mask.bool(), diff, torch.zeros_like(diff))


@ROLLOUT_IS_LEVELS.register("sequence")
def sequence_log_ratio(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """log rho = sum_t (old_t - rollout_t) over the response, the same value on each of its tokens."""
    total = masked_sum(old_log_prob - rollout_log_prob, response_mask, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return total.unsqueeze(-1).expand_as(old_log_prob) * response_mask.bool()


@ROLLOUT_IS_MODES.register("truncate")
def truncate(rho: Tensor, lower: float, upper: float) -> tuple[Tensor, Tensor]:
    """min(rho, upper); every token kept (`lower` is unused: truncation bounds only the top)."""
    return rho.clamp(max=upper), torch.ones_like(rho, dtype=torch.bool)


@ROLLOUT_IS_MODES.register("mask")
def mask(rho: Tensor, lower: float, upper: float) -> tuple[Tensor, Tensor]:
    """rho where lower <= rho <= upper, else 0 (the token is dropped)."""
    kept = (rho >= lower) & (rho <= upper)
    return torch.where(kept, rho, torch.zeros_like(rho)), kept


def rollout_importance_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token IS weights [B, R] (detached, 0 on padding) and their metrics (mismatch/rollout_is_*).

    `threshold_lower` None means 1 / threshold.
    """
    valid = response_mask.bool()
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    rho = ROLLOUT_IS_LEVELS.get(level)(old_log_prob.detach(), rollout_log_prob.detach(), response_mask).exp()
    weights, kept = ROLLOUT_IS_MODES.get(mode)(rho, lower, threshold)
    weights = torch.where(valid, weights, torch.zeros_like(weights))
    outside = (rho > threshold) | (rho < lower)
    metrics = {
        "mismatch/rollout_is_mean": float(masked_mean(weights, valid)),
        "mismatch/rollout_is_max": float(weights[valid].max()) if valid.any() else 0.0,
        "mismatch/rollout_is_min": float(weights[valid].min()) if valid.any() else 0.0,
        "mismatch/rollout_is_outside_fraction": float(masked_mean(outside.float(), valid)),
        "mismatch/rollout_is_masked_fraction": float(masked_mean((~kept).float(), valid)),
    }
    return weights.detach(), metrics


def mismatch_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the sampler is from the trainer on the sampled tokens.

    mismatch/kl: KL(pi_rollout || pi_old) estimated by mean(rollout - old) (k1, the tokens are drawn
    from pi_rollout); mismatch/k3_kl: the non-negative k3 estimate mean(rho - 1 - log rho);
    mismatch/max_ratio / min_ratio: the extreme token-level rho.
    """
    valid = response_mask.bool()
    log_rho = token_log_ratio(old_log_prob.detach(), rollout_log_prob.detach(), response_mask)
    rho = log_rho.exp()
    return {
        "mismatch/kl": float(masked_mean(-log_rho, valid)),
        "mismatch/k3_kl": float(masked_mean(rho - 1 - log_rho, valid)),
        "mismatch/max_ratio": float(rho[valid].max()) if valid.any() else 1.0,
        "mismatch/min_ratio": float(rho[valid].min()) if valid.any() else 1.0,
    }
