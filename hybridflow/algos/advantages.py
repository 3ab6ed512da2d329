"""The built-in advantage estimators' math, registered by name so the config can pick one (registry: adv_spec.py).

Each is registered with an `AdvantageEstimatorSpec` saying what the trainer must
provide (a critic, groups, a baseline such as ReMax's greedy response, sync
mode). Every estimator has the same signature (see `AdvantageEstimatorFn`):

    fn(token_level_rewards [B, R], response_mask [B, R], index [B], *,
       values=None, reward_baselines=None, gamma=1.0, lam=1.0,
       norm_adv_by_std_in_grpo=True, epsilon=1e-6, **unused) -> (advantages [B, R], returns [B, R])

`index` holds one group id (the prompt's uid) per sample; groups may have
any size and appear in any order. Outcome estimators use the sequence score
s_i = sum_t r_it over valid tokens. Padded positions of both outputs are 0.
For estimators without a critic, `returns` equals `advantages` (unused).

Choices and departures (from the papers and from verl):
- Groups of size 1 and groups whose scores are all equal get advantage
  exactly 0 in every group estimator (grpo, grpo_passk, rloo, opo, gpg,
  reinforce_plus_plus_baseline): there is no within-group signal. verl
  instead uses mean 0 / std 1 for singletons, i.e. the raw score.
- GAE, REINFORCE++ and ReMax scans skip masked positions: a masked token is
  not a step, so values and returns flow across it and its own outputs are 0.
  With right padding this is the ordinary episode end.
- GAE advantages are whitened over all valid tokens of the batch (PPO
  practice since the OpenAI baselines, not part of the GAE paper); returns
  are the un-whitened A + V.
- GPG uses the paper's correction alpha = B / (B - M) with M the number of
  samples in zero-signal groups (verl counts non-zero scores instead).
- REINFORCE++-baseline divides by the batch std without subtracting the
  batch mean again (paper and verl do), so flat groups stay exactly 0.
- ReMax and REINFORCE++ honour `gamma` (the papers use gamma = 1, the default).
- Group statistics are computed in float64 and cast back.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hybridflow.algos.adv_spec import BaselineContext, register_adv_est
from hybridflow.algos.core import masked_sum, masked_var, masked_whiten

# --- shared pieces -------------------------------------------------------------


def _check_inputs(rewards: Tensor, mask: Tensor, index: Sequence[Hashable] | np.ndarray) -> None:
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} must both be [B, R]"
        )
    if len(index) != rewards.shape[0]:
        raise ValueError(
            f"index has {len(index)} entries but the batch has {rewards.shape[0]} rows; pass one uid per sample"
        )


def _group_ids(index: Sequence[Hashable] | np.ndarray) -> Tensor:
    """Dense group ids 0..G-1 in order of first appearance; any hashable uid works."""
    ids: dict[Hashable, int] = {}
    return torch.tensor(
        [ids.setdefault(u, len(ids)) for u in np.asarray(index, dtype=object).tolist()], dtype=torch.long
    )


@dataclass
class _GroupStats:
    """Per-sample view of its group's statistics (float64, shape [B])."""

    mean: Tensor
    std: Tensor
    size: Tensor
    flat: Tensor  # bool: the group has one sample or all scores equal


def _group_stats(scores: Tensor, index: Sequence[Hashable] | np.ndarray) -> _GroupStats:
    ids = _group_ids(index).to(scores.device)
    s = scores.double()
    n_groups = int(ids.max()) + 1 if ids.numel() else 0
    count = torch.bincount(ids, minlength=n_groups).double()
    mean = torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, ids, s) / count
    sq = torch.zeros_like(mean).index_add_(0, ids, (s - mean[ids]).square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    hi = torch.full_like(mean, -torch.inf).scatter_reduce_(0, ids, s, "amax")
    lo = torch.full_like(mean, torch.inf).scatter_reduce_(0, ids, s, "amin")
    return _GroupStats(mean[ids], std[ids], count[ids], (hi == lo)[ids])


def _outcome_scores(rewards: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(rewards, mask, dim=-1)


def _per_token(seq_values: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Broadcast a [B] per-sequence value to the valid tokens of [B, R]."""
    return torch.where(
        mask.bool(), seq_values.to(dtype).unsqueeze(-1), torch.zeros((), dtype=dtype, device=mask.device)
    )


def _reverse_scan(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE recursion over valid tokens: A_t = delta_t + gamma*lam*A_{t+1}, delta_t = r_t + gamma*V_{t+1} - V_t.

    Masked positions are skipped (not a step) and give 0. With values = 0 and
    lam = 1 this is the discounted return G_t = sum_k gamma^k r_{t+k}.
    """
    valid = mask.bool()
    out = torch.zeros_like(rewards)
    next_adv = rewards.new_zeros(rewards.shape[0])
    next_val = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        v = valid[:, t]
        adv_t = rewards[:, t] + gamma * next_val - values[:, t] + gamma * lam * next_adv
        out[:, t] = torch.where(v, adv_t, 0.0)
        next_adv = torch.where(v, adv_t, next_adv)
        next_val = torch.where(v, values[:, t], next_val)
    return out


def _zero_flat(adv: Tensor, stats: _GroupStats) -> Tensor:
    return torch.where(stats.flat, torch.zeros_like(adv), adv)


# --- estimators ----------------------------------------------------------------


@register_adv_est("gae", needs_critic=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, "High-Dimensional Continuous Control Using GAE").

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = sum_l (gamma lam)^l delta_{t+l},  returns_t = A_t + V_t
    (V after the last valid token is 0). Advantages are then whitened over
    all valid tokens of the batch (PPO practice, not in the GAE paper).
    """
    _check_inputs(token_level_rewards, response_mask, index)
    if values is None:
        raise ValueError(
            "adv_estimator 'gae' needs values= from a critic; "
            "enable the critic or pick an outcome estimator such as 'grpo'"
        )
    adv = _reverse_scan(token_level_rewards, values, response_mask, gamma, lam)
    returns = torch.where(response_mask.bool(), adv + values, 0.0)
    return masked_whiten(adv, response_mask), returns


@register_adv_est("grpo", needs_groups=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """Group-relative outcome advantage (GRPO: Shao et al. 2024, DeepSeekMath, eq. in sec. 4.1.2).

    A_i = (s_i - mean_g(s)) / (std_g(s) + epsilon) with the unbiased std of the group.
    norm_adv_by_std_in_grpo=False gives Dr.GRPO (Liu et al. 2025, "Understanding
    R1-Zero-Like Training"): A_i = s_i - mean_g(s). Flat groups give 0.
    """
    _check_inputs(token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    adv = scores.double() - stats.mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (stats.std + epsilon)
    adv = _per_token(_zero_flat(adv, stats), response_mask, token_level_rewards.dtype)
    return adv, adv


@register_adv_est("grpo_passk", needs_groups=True)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """Pass@k advantage (Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using RL").

    For the max-of-group objective the leave-one-out contribution of sample i
    is max_g(s) - max_{g without i}(s): r_max - r_second for the best sample,
    0 for all others; divided by (std_g + epsilon) when norm_adv_by_std_in_grpo.
    Ties for the maximum give 0 (the best sample is not unique), so the result
    does not depend on order.
    """
    _check_inputs(token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards, response_mask).double()
    ids = _group_ids(index).to(scores.device)
    stats = _group_stats(scores, index)
    adv = torch.zeros_like(scores)
    for g in ids.unique().tolist():
        members = (ids == g).nonzero().squeeze(-1)
        if members.numel() < 2:
            continue
        top2, pos = scores[members].topk(2)
        adv[members[pos[0]]] = top2[0] - top2[1]
    if norm_adv_by_std_in_grpo:
        adv = adv / (stats.std + epsilon)
    adv = _per_token(_zero_flat(adv, stats), response_mask, token_level_rewards.dtype)
    return adv, adv


@register_adv_est("rloo", needs_groups=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

    A_i = s_i - (1/(n-1)) sum_{j != i} s_j = n/(n-1) (s_i - mean_g(s)). Singleton groups give 0.
    """
    _check_inputs(token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    adv = (scores.double() - stats.mean) * stats.size / (stats.size - 1).clamp(min=1)
    adv = _per_token(_zero_flat(adv, stats), response_mask, token_level_rewards.dtype)
    return adv, adv


@register_adv_est("opo", needs_groups=True)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """OPO length-weighted baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline").

    b_g = sum_j l_j s_j / sum_j l_j with l_j the valid length of sample j;  A_i = s_i - b_g.
    """
    _check_inputs(token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards, response_mask).double()
    lengths = response_mask.bool().sum(dim=-1).double()
    ids = _group_ids(index).to(scores.device)
    n_groups = int(ids.max()) + 1 if ids.numel() else 0
    weighted = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, lengths * scores)
    total_len = torch.zeros_like(weighted).index_add_(0, ids, lengths).clamp(min=1)
    adv = scores - (weighted / total_len)[ids]
    adv = _per_token(_zero_flat(adv, _group_stats(scores, index)), response_mask, token_level_rewards.dtype)
    return adv, adv


@register_adv_est("gpg", needs_groups=True)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """GPG corrected group advantage (Chu et al. 2025, "GPG: A Simple and Strong RL Baseline for Model Reasoning").

    A_i = alpha (s_i - mean_g(s)) / F, alpha = B / (B - M), M = samples in
    zero-signal (flat) groups, F = std_g + epsilon if norm_adv_by_std_in_grpo else 1.
    """
    _check_inputs(token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    adv = scores.double() - stats.mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (stats.std + epsilon)
    batch = scores.shape[0]
    alpha = batch / max(batch - int(stats.flat.sum()), 1)
    adv = _per_token(_zero_flat(adv * alpha, stats), response_mask, token_level_rewards.dtype)
    return adv, adv


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    *,
    gamma: float = 1.0,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

    G_t = sum_{k>=t} gamma^{k-t} r_k over valid tokens; A = whiten(G) over all
    valid tokens of the batch; returns = G.
    """
    _check_inputs(token_level_rewards, response_mask, index)
    returns = _reverse_scan(token_level_rewards, torch.zeros_like(token_level_rewards), response_mask, gamma, 1.0)
    return masked_whiten(returns, response_mask), returns


@register_adv_est("reinforce_plus_plus_baseline", needs_groups=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): group-mean baseline, then batch normalisation.

    A_i = (s_i - mean_g(s)) / std_batch, std over the valid tokens of the batch.
    Departure: the paper also subtracts the batch mean; we only rescale, so
    flat groups keep exactly 0 (the group baseline already centres A).
    """
    _check_inputs(token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards, response_mask)
    stats = _group_stats(scores, index)
    centred = _per_token(_zero_flat(scores.double() - stats.mean, stats), response_mask, token_level_rewards.dtype)
    adv = centred * torch.rsqrt(masked_var(centred, response_mask) + 1e-8)
    return adv, adv


def remax_greedy_baseline(ctx: BaselineContext) -> Tensor:
    """ReMax's baseline: the score of one greedy response per prompt (current weights), repeated for its n samples."""
    return ctx.generate_scores(do_sample=False, n=1).repeat_interleave(ctx.n)


@register_adv_est("remax", baseline=remax_greedy_baseline, sync_only=True)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    *,
    reward_baselines: Tensor | None = None,
    gamma: float = 1.0,
    **unused: Any,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient RL Method for Aligning LLMs").

    A_t = G_t - b with G_t = sum_{k>=t} gamma^{k-t} r_k and b = reward_baselines
    [B], the reward of the greedy response to the same prompt; returns = G.
    """
    _check_inputs(token_level_rewards, response_mask, index)
    if reward_baselines is None:
        raise ValueError("adv_estimator 'remax' needs reward_baselines= (the greedy response's reward, one per sample)")
    returns = _reverse_scan(token_level_rewards, torch.zeros_like(token_level_rewards), response_mask, gamma, 1.0)
    adv = torch.where(response_mask.bool(), returns - reward_baselines.to(returns.dtype).unsqueeze(-1), 0.0)
    return adv, returns
