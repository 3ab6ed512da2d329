"""Policy losses (registered by name, config: actor.policy_loss_mode); the value loss is in value_loss.py.

Every policy loss has the signature (see `PolicyLossFn`):

    fn(old_log_prob [B, R], log_prob [B, R], advantages [B, R], response_mask [B, R], *,
       loss_agg_mode="token-mean", config: PolicyLossConfig, global_norm=None,
       rollout_log_probs=None, rollout_is_weights=None) -> (loss scalar, stats)

and returns a per-token loss matrix reduced by `agg_loss` (see core.py for
the global-normalisation contract). `stats` holds detached tensors:
pg_clipfrac, pg_clipfrac_lower (dual-clip; 0 where it does not apply) and
ppo_kl = mean over valid tokens of (old_log_prob - log_prob), plus
loss-specific extras.

Departures (from the papers and from verl):
- The per-token log-ratio is clamped to [-20, 20] before exp (numerical
  safety; it never binds in sane training).
- GSPO uses its own clip range fields (gspo_clip_ratio_low/high, paper
  defaults 3e-4 / 4e-4) instead of reusing PPO's clip_ratio_*. The paper
  aggregates "seq-mean-token-mean"; we honour whatever loss_agg_mode is given.
- CISPO's loss value is -sg(clip(r)) * A * exp(logp - sg(logp)): the same
  gradient as the paper's -sg(clip(r)) * A * logp, but its value reads like a
  PPO surrogate (-A * clip(r)) instead of depending on logp's magnitude.
- GPG's loss is the paper's -A * log_prob; its value is not a surrogate.
- Clip-Cov draws its tokens with the global torch RNG (seeded by the trainer).
- Truncated importance sampling (tis_imp_ratio_cap; Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training") scales
  every loss's per-token terms by min(exp(old - rollout), cap), detached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from hybridflow.algos.core import GlobalNorm, agg_loss, masked_mean
from hybridflow.utils.config_loader import Section
from hybridflow.utils.registry import Registry

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossConfig(Section):
    """Hyper-parameters of all policy losses (each loss reads the fields it needs)."""

    clip_ratio: float = 0.2
    """PPO clip epsilon, used for both sides unless clip_ratio_low/high are set."""
    clip_ratio_low: float | None = None
    """Lower clip epsilon: ratio is clipped at 1 - clip_ratio_low (None: clip_ratio)."""
    clip_ratio_high: float | None = None
    """Upper clip epsilon: ratio is clipped at 1 + clip_ratio_high (None: clip_ratio; DAPO uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound c > 1: for A < 0 the loss is at most -c * A (Ye et al. 2020)."""
    loss_norm_length: int | None = None
    """Constant divisor of "seq-mean-token-sum-norm" (normally the max response length; None: padded width)."""
    gspo_clip_ratio_low: float = 3e-4
    """GSPO: lower clip epsilon of the sequence-level ratio."""
    gspo_clip_ratio_high: float = 4e-4
    """GSPO: upper clip epsilon of the sequence-level ratio."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: fraction of valid tokens whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: tokens are candidates only if their covariance is above this."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: ... and below this."""
    kl_cov_ratio: float = 2e-4
    """KL-Cov: fraction of valid tokens (largest covariance) that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """KL-Cov: coefficient of |log_prob - old_log_prob| on the selected tokens."""
    cispo_clip_ratio_low: float = 1.0
    """CISPO: IS weight clipped below at 1 - this (1.0: no lower bound, as in MiniMax-M1)."""
    cispo_clip_ratio_high: float = 0.28
    """CISPO: IS weight clipped above at 1 + this."""
    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature for tokens with positive advantage."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature for tokens with non-positive advantage (sharper decay)."""
    tis_imp_ratio_cap: float | None = None
    """Truncated IS cap for rollout/trainer mismatch; None disables (then rollout_log_probs is ignored)."""

    def __post_init__(self) -> None:
        for key in ("clip_ratio", "gspo_clip_ratio_low", "gspo_clip_ratio_high", "sapo_tau_pos", "sapo_tau_neg"):
            if getattr(self, key) <= 0:
                raise ValueError(f"policy_loss.{key} must be > 0, got {getattr(self, key)}")
        if not 0 < self.low <= 1 or self.high <= 0:
            raise ValueError(
                f"policy_loss.clip_ratio_low must be in (0, 1] and clip_ratio_high > 0, got {self.low}, {self.high}"
            )
        if self.clip_ratio_c <= 1:
            raise ValueError(f"policy_loss.clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"policy_loss.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"policy_loss.clip_cov_lb ({self.clip_cov_lb}) must be < clip_cov_ub ({self.clip_cov_ub})")
        if not 0 < self.cispo_clip_ratio_low <= 1 or self.cispo_clip_ratio_high <= 0:
            raise ValueError("policy_loss.cispo_clip_ratio_low must be in (0, 1] and cispo_clip_ratio_high > 0")
        if self.tis_imp_ratio_cap is not None and self.tis_imp_ratio_cap <= 0:
            raise ValueError(f"policy_loss.tis_imp_ratio_cap must be > 0 or None, got {self.tis_imp_ratio_cap}")
        if self.loss_norm_length is not None and self.loss_norm_length < 1:
            raise ValueError(f"policy_loss.loss_norm_length must be >= 1 or None, got {self.loss_norm_length}")

    @property
    def low(self) -> float:
        """Effective lower clip epsilon."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """Effective upper clip epsilon."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


Stats = dict[str, float | Tensor]


class PolicyLossFn(Protocol):
    """The uniform policy-loss signature the actor calls by name."""

    def __call__(
        self, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Stats]: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", "actor.policy_loss_mode", "add one with @hybridflow.algos.register_policy_loss"
)
"""Policy losses by name."""


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (config: actor.policy_loss_mode)."""
    return POLICY_LOSSES.register(name, override=override)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name`; unknown names raise with the valid list."""
    return POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Sorted names of all registered policy losses."""
    return POLICY_LOSSES.names()


# --- shared pieces -------------------------------------------------------------


def log_ratio(old_log_prob: Tensor, log_prob: Tensor) -> Tensor:
    """log r = log pi - log pi_old, clamped to [-20, 20]."""
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Detached share of valid tokens where `flags` is true (a clip-fraction stat)."""
    return masked_mean(flags.float(), mask).detach()


def finish_policy_loss(
    loss_mat: Tensor,
    old_log_prob: Tensor,
    log_prob: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: PolicyLossConfig,
    global_norm: GlobalNorm | None,
    rollout_log_probs: Tensor | None,
    stats: Stats,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """Apply truncated IS (if configured) and the rollout IS weights (if given), aggregate, and add
    ppo_kl; for loss authors."""
    if config.tis_imp_ratio_cap is not None:
        if rollout_log_probs is None:
            raise ValueError(
                "policy_loss.tis_imp_ratio_cap is set but rollout_log_probs is None; "
                "record rollout log-probs or unset the cap"
            )
        weight = torch.exp(old_log_prob - rollout_log_probs).clamp(max=config.tis_imp_ratio_cap)
        loss_mat = loss_mat * weight.detach()
    if rollout_is_weights is not None:  # algorithm.rollout_is, computed on the controller (algos/rollout_is.py)
        loss_mat = loss_mat * rollout_is_weights.detach()
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_norm, config.loss_norm_length)
    stats = {"pg_clipfrac_lower": torch.zeros(()), **stats}
    stats["ppo_kl"] = masked_mean(old_log_prob - log_prob, response_mask).detach()
    return loss, stats


def clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r, 1-low, 1+high)) and the flags where the clipped term won."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - low, 1 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


# --- policy losses -------------------------------------------------------------


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
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
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clip and dual clip.

    r = exp(logp - logp_old);  l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));
    for A < 0 additionally l = min(l, -c A) (dual clip, Ye et al. 2020, "Mastering
    Complex Control in MOBA Games with Deep RL"). eps_high > eps_low is DAPO's
    clip-higher (Yu et al. 2025). pg_clipfrac: share where the clipped term won;
    pg_clipfrac_lower: share where the dual clip bound applied.
    """
    config = config or PolicyLossConfig()
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    clipped, clip_flags = clipped_surrogate(ratio, advantages, config.low, config.high)
    dual_bound = -advantages * config.clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clipped, dual_bound), clipped)
    stats: Stats = {
        "pg_clipfrac": masked_fraction(clip_flags, response_mask),
        "pg_clipfrac_lower": masked_fraction((clipped > dual_bound) & negative, response_mask),
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


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
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
    """GSPO-token (Zheng et al. 2025, Qwen, "Group Sequence Policy Optimization", eq. 10-11).

    s_i = exp((1/|y_i|) sum_t (logp_it - logp_old_it))  (length-normalised sequence ratio);
    s_it = sg(s_i) * pi_it / sg(pi_it) (value s_i, gradient per token; log s_it clamped at 10);
    l_it = max(-A_it s_it, -A_it clip(s_it, 1 - gspo_low, 1 + gspo_high)).
    The paper aggregates with "seq-mean-token-mean".
    """
    config = config or PolicyLossConfig()
    seq_log_ratio = masked_mean(log_prob - old_log_prob, response_mask, dim=-1)
    log_s = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(log_s.clamp(max=10.0))
    loss_mat, clip_flags = clipped_surrogate(ratio, advantages, config.gspo_clip_ratio_low, config.gspo_clip_ratio_high)
    stats: Stats = {"pg_clipfrac": masked_fraction(clip_flags, response_mask)}
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


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
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
    """GPG plain policy gradient (Chu et al. 2025, "GPG"): l_t = -A_t log pi(y_t). No ratio, no clip."""
    config = config or PolicyLossConfig()
    loss_mat = -advantages * log_prob
    stats: Stats = {"pg_clipfrac": torch.zeros(())}
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


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
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
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): clip the IS weight, never drop a token's gradient.

    w = sg(clip(r, 1 - eps_low, 1 + eps_high));  grad l_t = -w A_t grad log pi(y_t).
    Computed as l_t = -w A_t exp(logp - sg(logp)) (value -w A_t, same gradient).
    pg_clipfrac: share of tokens whose weight was clipped (either side).
    """
    config = config or PolicyLossConfig()
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    weight = ratio.clamp(1 - config.cispo_clip_ratio_low, 1 + config.cispo_clip_ratio_high).detach()
    loss_mat = -advantages * weight * torch.exp(log_prob - log_prob.detach())
    stats: Stats = {"pg_clipfrac": masked_fraction(weight != ratio.detach(), response_mask)}
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


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
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
    """SAPO soft gate (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization").

    f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg;  l_t = -A_t f(r_t).
    Its gradient weight 4 sigma (1 - sigma) is 1 at r = 1 and decays smoothly
    off-policy (no hard clip, so pg_clipfrac is 0). Note l_t = -2 A_t / tau at r = 1.
    """
    config = config or PolicyLossConfig()
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    tau = torch.where(advantages > 0, config.sapo_tau_pos, config.sapo_tau_neg).to(ratio.dtype)
    loss_mat = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    stats: Stats = {"pg_clipfrac": torch.zeros(())}
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
