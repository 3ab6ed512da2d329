"""Covariance-based entropy-preserving policy losses (Cui et al. 2025).

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models": entropy collapse is driven by tokens whose
log-probability and advantage covary strongly. For each valid token

    Cov_t = (A_t - mean(A)) * (logp_t - mean(logp))      (means over valid tokens of the micro-batch, detached)

Clip-Cov removes the gradient of a few random tokens with Cov in
(clip_cov_lb, clip_cov_ub); KL-Cov adds a KL penalty to the top-k tokens by Cov.

Departures: the statistics are over the micro-batch the loss sees (the
paper: the batch); Clip-Cov samples with the global torch RNG.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algos.core import GlobalNorm, masked_mean
from hybridflow.algos.losses import (
    PolicyLossConfig,
    Stats,
    clipped_surrogate,
    finish_policy_loss,
    log_ratio,
    masked_fraction,
    register_policy_loss,
)


@torch.no_grad()
def token_covariance(advantages: Tensor, log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """Cov_t = (A_t - mean A) (logp_t - mean logp) over valid tokens; -inf at padding."""
    cov = (advantages - masked_mean(advantages, response_mask)) * (log_prob - masked_mean(log_prob, response_mask))
    return torch.where(response_mask.bool(), cov, -torch.inf)


def _num_selected(ratio: float, response_mask: Tensor) -> int:
    n_valid = int(response_mask.bool().sum())
    return min(max(int(ratio * n_valid), 1), n_valid) if ratio > 0 else 0


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    global_norm: GlobalNorm | None = None,
    rollout_log_probs: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """Clip-Cov (Cui et al. 2025, sec. 4): PPO clipped loss, minus the gradient of a few high-Cov tokens.

    Candidates: valid tokens not already ratio-clipped with lb < Cov_t < ub;
    k = max(1, floor(clip_cov_ratio * N_valid)) of them, drawn at random, get
    loss 0 (no gradient). Stats: pg_clipfrac (ratio clip), pg_covclipfrac (cut).
    """
    config = config or PolicyLossConfig()
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    loss_mat, clip_flags = clipped_surrogate(ratio, advantages, config.low, config.high)
    cov = token_covariance(advantages, log_prob.detach(), response_mask)
    candidates = response_mask.bool() & ~clip_flags & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    idx = candidates.flatten().nonzero().squeeze(-1)
    k = _num_selected(config.clip_cov_ratio, response_mask)
    if idx.numel() > k:
        idx = idx[torch.randperm(idx.numel(), device=idx.device)[:k]]
    cut = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    cut[idx] = True
    cut = cut.view_as(candidates)
    loss_mat = torch.where(cut, torch.zeros_like(loss_mat), loss_mat)
    stats: Stats = {
        "pg_clipfrac": masked_fraction(clip_flags, response_mask),
        "pg_covclipfrac": masked_fraction(cut, response_mask),
    }
    return finish_policy_loss(
        loss_mat,
        old_log_prob,
        log_prob,
        response_mask,
        loss_agg_mode,
        config,
        global_norm,
        rollout_log_probs,
        stats,
        rollout_is_weights,
    )


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    global_norm: GlobalNorm | None = None,
    rollout_log_probs: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """KL-Cov (Cui et al. 2025, sec. 4): l_t = -A_t r_t, plus ppo_kl_coef |logp_t - logp_old_t| on the top-k Cov tokens.

    k = max(1, floor(kl_cov_ratio * N_valid)); no ratio clipping (pg_clipfrac 0).
    Stats: pg_klcovfrac (share of valid tokens penalised).
    """
    config = config or PolicyLossConfig()
    log_r = log_ratio(old_log_prob, log_prob)
    loss_mat = -advantages * torch.exp(log_r)
    cov = token_covariance(advantages, log_prob.detach(), response_mask)
    k = _num_selected(config.kl_cov_ratio, response_mask)
    picked = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    # a stable sort breaks ties by position (topk's order among equal values is unspecified;
    # with two valid tokens the two covariances are always equal)
    picked[torch.sort(cov.flatten(), descending=True, stable=True).indices[:k]] = True
    picked = picked.view_as(cov)
    loss_mat = loss_mat + torch.where(picked, config.ppo_kl_coef * log_r.abs(), torch.zeros_like(loss_mat))
    stats: Stats = {"pg_clipfrac": torch.zeros(()), "pg_klcovfrac": masked_fraction(picked, response_mask)}
    return finish_policy_loss(
        loss_mat,
        old_log_prob,
        log_prob,
        response_mask,
        loss_agg_mode,
        config,
        global_norm,
        rollout_log_probs,
        stats,
        rollout_is_weights,
    )
