"""Policy losses, registered by name (config: actor.policy_loss_mode); the critic's loss is in value_loss.py.

A policy loss is its math: a function of `PolicyLossInputs` (old_log_prob, log_prob, advantages and
response_mask [B, R], and the `PolicyLossConfig`) returning the per-token loss [B, R], or that and a dict of
extra detached stats. `@policy_loss(name)` registers it:

    @policy_loss("reinforce")
    def reinforce(x: PolicyLossInputs) -> Tensor:
        return -x.advantages * x.log_prob

and wraps it in what every loss shares (`PolicyLoss`, `finish_policy_loss`): the default config, truncated IS
and the rollout IS weights, aggregation by loss_agg_mode with `agg_loss` (see core.py for the
global-normalisation contract), and the stats every loss reports -- pg_clipfrac and pg_clipfrac_lower (0 unless
the math reports them: the share of valid tokens where a clip bound, or the dual clip, applied) and ppo_kl = mean
over valid tokens of (old_log_prob - log_prob). Stats are detached tensors. The actor calls every registered
loss with the uniform signature (see `PolicyLossFn`):

    fn(old_log_prob [B, R], log_prob [B, R], advantages [B, R], response_mask [B, R], *,
       loss_agg_mode="token-mean", config: PolicyLossConfig, global_norm=None,
       rollout_log_probs=None, rollout_is_weights=None) -> (loss scalar, stats)

A loss that must own those steps registers a function of that signature with `@register_policy_loss(name)`
(it may call `finish_policy_loss` itself).

Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models") find the tokens whose log-probability and advantage covary most,
Cov_t = (A_t - mean(A)) * (logp_t - mean(logp)) over valid tokens (detached): Clip-Cov removes the gradient of a
few random tokens with Cov in (clip_cov_lb, clip_cov_ub), KL-Cov adds a KL penalty to the top-k tokens by Cov.

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
- Clip-Cov and KL-Cov take their statistics over the micro-batch the loss sees
  (the paper: the batch); Clip-Cov draws its tokens with the global torch RNG
  (seeded by the trainer).
- Truncated importance sampling (tis_imp_ratio_cap; Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training") scales
  every loss's per-token terms by min(exp(old - rollout), cap), detached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from hybridflow.algos.core import GlobalNorm, agg_loss, masked_fraction, masked_mean
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
    "policy loss", "actor.policy_loss_mode", "add one with @hybridflow.algos.policy_loss"
)
"""Policy losses by name."""


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a loss of the full `PolicyLossFn` signature under `name` (config:
    actor.policy_loss_mode); for a loss that only computes its per-token math, use `policy_loss`."""
    return POLICY_LOSSES.register(name, override=override)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name`; unknown names raise with the valid list."""
    return POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Sorted names of all registered policy losses."""
    return POLICY_LOSSES.names()


# --- what every loss shares ----------------------------------------------------


def log_ratio(old_log_prob: Tensor, log_prob: Tensor) -> Tensor:
    """log r = log pi - log pi_old, clamped to [-20, 20]."""
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a loss's math reads: one micro-batch's tensors and the loss config."""

    old_log_prob: Tensor
    """Log-probs of the response tokens under the policy that generated them [B, R] (no gradient)."""
    log_prob: Tensor
    """Log-probs under the policy being trained [B, R] (the gradient flows through these)."""
    advantages: Tensor
    """Per-token advantages [B, R]."""
    response_mask: Tensor
    """1 at valid response tokens, 0 at padding [B, R]."""
    config: PolicyLossConfig
    """The loss hyper-parameters (actor.policy_loss)."""

    @property
    def log_ratio(self) -> Tensor:
        """log r = log_prob - old_log_prob, clamped to [-20, 20]."""
        return log_ratio(self.old_log_prob, self.log_prob)

    @property
    def ratio(self) -> Tensor:
        """r = exp(log r), the per-token importance ratio."""
        return torch.exp(self.log_ratio)

    def fraction(self, flags: Tensor) -> Tensor:
        """Detached share of valid tokens where `flags` is true (a clip-fraction stat)."""
        return masked_fraction(flags, self.response_mask)


PolicyLossMath = Callable[[PolicyLossInputs], "Tensor | tuple[Tensor, Stats]"]
"""x -> per-token loss [B, R], or (per-token loss, extra detached stats): a policy loss's own math."""


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
    """Apply truncated IS (if configured) and the rollout IS weights (if given), aggregate, and complete the
    stats (pg_clipfrac and pg_clipfrac_lower default to 0; ppo_kl). `PolicyLoss` calls it for every loss."""
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
    stats = {"pg_clipfrac_lower": torch.zeros(()), "pg_clipfrac": torch.zeros(()), **stats}
    stats["ppo_kl"] = masked_mean(old_log_prob - log_prob, response_mask).detach()
    return loss, stats


class PolicyLoss:
    """A loss's math with what every loss shares around it, called with the uniform `PolicyLossFn` signature.

    `math` is the wrapped function, `name` the name it is registered under; `__name__` and the docstring are
    the math's.
    """

    def __init__(self, math: PolicyLossMath, name: str) -> None:
        self.math = math
        self.name = name
        functools.update_wrapper(self, math, updated=())
        del self.__wrapped__  # inspect.signature shows the signature the actor calls, not the math's

    def __repr__(self) -> str:
        return f"PolicyLoss({self.name!r})"

    def __call__(
        self,
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
        config = config or PolicyLossConfig()
        out = self.math(PolicyLossInputs(old_log_prob, log_prob, advantages, response_mask, config))
        loss_mat, stats = out if isinstance(out, tuple) else (out, {})
        if not isinstance(loss_mat, Tensor) or loss_mat.shape != response_mask.shape:
            got = tuple(loss_mat.shape) if isinstance(loss_mat, Tensor) else type(loss_mat).__name__
            raise ValueError(
                f"actor.policy_loss_mode={self.name!r}: its math returned a loss of shape {got}; return the "
                f"per-token loss, shape {tuple(response_mask.shape)} here (the registry aggregates it by loss_agg_mode)"
            )
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


def policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLossMath], PolicyLoss]:
    """Decorator registering a loss's math under `name` (config: actor.policy_loss_mode); returns the
    registered `PolicyLoss`, callable like every policy loss."""

    def add(math: PolicyLossMath) -> PolicyLoss:
        return POLICY_LOSSES.register(name, PolicyLoss(math, name), override=override)

    return add


def clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r, 1-low, 1+high)) and the flags where the clipped term won."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - low, 1 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@torch.no_grad()
def token_covariance(advantages: Tensor, log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """Cov_t = (A_t - mean A) (logp_t - mean logp) over valid tokens; -inf at padding."""
    cov = (advantages - masked_mean(advantages, response_mask)) * (log_prob - masked_mean(log_prob, response_mask))
    return torch.where(response_mask.bool(), cov, -torch.inf)


def _num_selected(ratio: float, response_mask: Tensor) -> int:
    n_valid = int(response_mask.bool().sum())
    return min(max(int(ratio * n_valid), 1), n_valid) if ratio > 0 else 0


# --- policy losses -------------------------------------------------------------


@policy_loss("vanilla")
def compute_policy_loss_vanilla(x: PolicyLossInputs) -> tuple[Tensor, Stats]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clip and dual clip.

    r = exp(logp - logp_old);  l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));
    for A < 0 additionally l = min(l, -c A) (dual clip, Ye et al. 2020, "Mastering
    Complex Control in MOBA Games with Deep RL"). eps_high > eps_low is DAPO's
    clip-higher (Yu et al. 2025). pg_clipfrac: share where the clipped term won;
    pg_clipfrac_lower: share where the dual clip bound applied.
    """
    clipped, clip_flags = clipped_surrogate(x.ratio, x.advantages, x.config.low, x.config.high)
    dual_bound = -x.advantages * x.config.clip_ratio_c
    negative = x.advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clipped, dual_bound), clipped)
    return loss_mat, {
        "pg_clipfrac": x.fraction(clip_flags),
        "pg_clipfrac_lower": x.fraction((clipped > dual_bound) & negative),
    }


@policy_loss("gspo")
def compute_policy_loss_gspo(x: PolicyLossInputs) -> tuple[Tensor, Stats]:
    """GSPO-token (Zheng et al. 2025, Qwen, "Group Sequence Policy Optimization", eq. 10-11).

    s_i = exp((1/|y_i|) sum_t (logp_it - logp_old_it))  (length-normalised sequence ratio);
    s_it = sg(s_i) * pi_it / sg(pi_it) (value s_i, gradient per token; log s_it clamped at 10);
    l_it = max(-A_it s_it, -A_it clip(s_it, 1 - gspo_low, 1 + gspo_high)).
    The paper aggregates with "seq-mean-token-mean".
    """
    seq_log_ratio = masked_mean(x.log_prob - x.old_log_prob, x.response_mask, dim=-1)
    log_s = seq_log_ratio.detach().unsqueeze(-1) + x.log_prob - x.log_prob.detach()
    ratio = torch.exp(log_s.clamp(max=10.0))
    cfg = x.config
    loss_mat, clip_flags = clipped_surrogate(ratio, x.advantages, cfg.gspo_clip_ratio_low, cfg.gspo_clip_ratio_high)
    return loss_mat, {"pg_clipfrac": x.fraction(clip_flags)}


@policy_loss("gpg")
def compute_policy_loss_gpg(x: PolicyLossInputs) -> Tensor:
    """GPG plain policy gradient (Chu et al. 2025, "GPG"): l_t = -A_t log pi(y_t). No ratio, no clip."""
    return -x.advantages * x.log_prob


@policy_loss("cispo")
def compute_policy_loss_cispo(x: PolicyLossInputs) -> tuple[Tensor, Stats]:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): clip the IS weight, never drop a token's gradient.

    w = sg(clip(r, 1 - eps_low, 1 + eps_high));  grad l_t = -w A_t grad log pi(y_t).
    Computed as l_t = -w A_t exp(logp - sg(logp)) (value -w A_t, same gradient).
    pg_clipfrac: share of tokens whose weight was clipped (either side).
    """
    ratio = x.ratio
    weight = ratio.clamp(1 - x.config.cispo_clip_ratio_low, 1 + x.config.cispo_clip_ratio_high).detach()
    loss_mat = -x.advantages * weight * torch.exp(x.log_prob - x.log_prob.detach())
    return loss_mat, {"pg_clipfrac": x.fraction(weight != ratio.detach())}


@policy_loss("sapo")
def compute_policy_loss_sapo(x: PolicyLossInputs) -> Tensor:
    """SAPO soft gate (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization").

    f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg;  l_t = -A_t f(r_t).
    Its gradient weight 4 sigma (1 - sigma) is 1 at r = 1 and decays smoothly
    off-policy (no hard clip, so pg_clipfrac is 0). Note l_t = -2 A_t / tau at r = 1.
    """
    ratio = x.ratio
    tau = torch.where(x.advantages > 0, x.config.sapo_tau_pos, x.config.sapo_tau_neg).to(ratio.dtype)
    return -x.advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))


@policy_loss("clip_cov")
def compute_policy_loss_clip_cov(x: PolicyLossInputs) -> tuple[Tensor, Stats]:
    """Clip-Cov (Cui et al. 2025, sec. 4): PPO clipped loss, minus the gradient of a few high-Cov tokens.

    Candidates: valid tokens not already ratio-clipped with lb < Cov_t < ub;
    k = max(1, floor(clip_cov_ratio * N_valid)) of them, drawn at random, get
    loss 0 (no gradient). Stats: pg_clipfrac (ratio clip), pg_covclipfrac (cut).
    """
    cfg, mask = x.config, x.response_mask
    loss_mat, clip_flags = clipped_surrogate(x.ratio, x.advantages, cfg.low, cfg.high)
    cov = token_covariance(x.advantages, x.log_prob.detach(), mask)
    candidates = mask.bool() & ~clip_flags & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    idx = candidates.flatten().nonzero().squeeze(-1)
    k = _num_selected(cfg.clip_cov_ratio, mask)
    if idx.numel() > k:
        idx = idx[torch.randperm(idx.numel(), device=idx.device)[:k]]
    cut = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    cut[idx] = True
    cut = cut.view_as(candidates)
    loss_mat = torch.where(cut, torch.zeros_like(loss_mat), loss_mat)
    return loss_mat, {"pg_clipfrac": x.fraction(clip_flags), "pg_covclipfrac": x.fraction(cut)}


@policy_loss("kl_cov")
def compute_policy_loss_kl_cov(x: PolicyLossInputs) -> tuple[Tensor, Stats]:
    """KL-Cov (Cui et al. 2025, sec. 4): l_t = -A_t r_t, plus ppo_kl_coef |logp_t - logp_old_t| on the top-k Cov tokens.

    k = max(1, floor(kl_cov_ratio * N_valid)); no ratio clipping (pg_clipfrac 0).
    Stats: pg_klcovfrac (share of valid tokens penalised).
    """
    log_r = x.log_ratio
    loss_mat = -x.advantages * torch.exp(log_r)
    cov = token_covariance(x.advantages, x.log_prob.detach(), x.response_mask)
    k = _num_selected(x.config.kl_cov_ratio, x.response_mask)
    picked = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    # a stable sort breaks ties by position (topk's order among equal values is unspecified;
    # with two valid tokens the two covariances are always equal)
    picked[torch.sort(cov.flatten(), descending=True, stable=True).indices[:k]] = True
    picked = picked.view_as(cov)
    loss_mat = loss_mat + torch.where(picked, x.config.ppo_kl_coef * log_r.abs(), torch.zeros_like(loss_mat))
    return loss_mat, {"pg_klcovfrac": x.fraction(picked)}
