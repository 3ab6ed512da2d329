"""Preference losses (DPO and relatives), registered by name (config: dpo.loss_type).

Every loss sees one preference pair per row, as sequence-level log-ratios against the reference policy:

    fn(chosen_logratios [B], rejected_logratios [B], chosen_tokens [B], rejected_tokens [B], config) -> losses [B]

where `*_logratios` = log pi(y|x) - log pi_ref(y|x), each log-prob summed over the response tokens
(0 in place of the reference with `reference_free`). `dpo_loss` applies what every loss shares: the
log-ratios, the reduction over pairs, and the detached stats named as TRL's DPOTrainer logs them:

    rewards/chosen     mean of beta * chosen_logratios (the implicit reward of the preferred response)
    rewards/rejected   mean of beta * rejected_logratios
    rewards/margins    mean of rewards/chosen - rewards/rejected per pair
    rewards/accuracies share of pairs whose chosen reward is strictly above the rejected one
    logps/chosen       mean summed log-prob of the chosen responses under the policy
    logps/rejected     ... of the rejected ones

The losses, with z = chosen_logratios - rejected_logratios and eps = label_smoothing:
- sigmoid (Rafailov et al. 2023, eq. 7): -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z). With
  eps > 0 this is conservative DPO (cDPO, Mitchell 2023), as TRL's DPOTrainer computed `loss_type="sigmoid"`
  with `label_smoothing` before 1.0; TRL 1.x ignores label_smoothing for sigmoid (eps = 0 is the same in both).
- robust (Chowdhury et al. 2024): (-(1 - eps) log sigmoid(beta z) + eps log sigmoid(-beta z)) / (1 - 2 eps),
  TRL's `loss_type="robust"`, where label_smoothing is the chance a label is flipped.
- hinge (SLiC, Zhao et al. 2023): relu(1 - beta z).
- ipo (Azar et al. 2023, eq. 17): (z' - 1 / (2 beta))^2 with z' the difference of the log-ratios each divided
  by its response's token count, as TRL computes it (the paper's log-ratios are not length-normalised).

Departure from TRL: the reduction is the sum over pairs divided by `num_pairs`, the pair count of the whole
step over all ranks (the mean over a batch when None), so micro-batching and data parallelism leave it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridflow.utils.config_loader import Section
from hybridflow.utils.registry import Registry

PairLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, "DPOLossConfig"], Tensor]
"""(chosen_logratios, rejected_logratios, chosen_tokens, rejected_tokens, config) -> per-pair losses [B]."""


@dataclass(frozen=True)
class PreferenceLoss:
    """A registered preference loss and what the config check must know about it."""

    fn: PairLossFn
    """The loss per pair (module docstring)."""
    label_smoothing: bool = False
    """Whether the loss reads dpo.label_smoothing (others refuse a non-zero value)."""
    max_label_smoothing: float = 0.5
    """Largest label_smoothing the loss accepts (exclusive when `label_smoothing_open`)."""
    label_smoothing_open: bool = False
    """Whether max_label_smoothing itself is refused (robust divides by 1 - 2 eps)."""


PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry(
    "preference loss",
    "dpo.loss_type",
    "add one with hybridflow.algos.dpo.PREFERENCE_LOSSES.register(name, PreferenceLoss(fn)) in a trainer.plugins "
    "module, or give a module:function path",
    wrap=PreferenceLoss,
)
"""Preference losses by name."""


@dataclass
class DPOLossConfig(Section):
    """The preference loss and its hyper-parameters (TRL's DPOConfig names)."""

    loss_type: str = "sigmoid"
    """Loss by name: sigmoid (DPO), ipo, hinge, robust, or a module:function path (hybridflow/algos/dpo.py)."""
    beta: float = 0.1
    """Strength of the pull towards the reference (larger: stay closer); IPO's tau."""
    label_smoothing: float = 0.0
    """Assumed chance that a pair's label is wrong: cDPO for sigmoid (in [0, 0.5]), robust DPO (in [0, 0.5))."""
    reference_free: bool = False
    """Compare the policy's log-probs directly (a reference of log-prob 0): no reference forward."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        spec = PREFERENCE_LOSSES.get(self.loss_type)
        eps = self.label_smoothing
        if not spec.label_smoothing:
            if eps != 0:
                raise ValueError(
                    f"dpo.label_smoothing={eps} does not apply to dpo.loss_type={self.loss_type}; "
                    "use loss_type=sigmoid (cDPO) or robust, or set label_smoothing=0"
                )
            return
        too_big = eps >= spec.max_label_smoothing if spec.label_smoothing_open else eps > spec.max_label_smoothing
        if eps < 0 or too_big:
            bound = ")" if spec.label_smoothing_open else "]"
            raise ValueError(
                f"dpo.label_smoothing must be in [0, {spec.max_label_smoothing}{bound} for "
                f"dpo.loss_type={self.loss_type}, got {eps}"
            )


def sigmoid_loss(chosen: Tensor, rejected: Tensor, _ct: Tensor, _rt: Tensor, cfg: DPOLossConfig) -> Tensor:
    """DPO, or cDPO with label smoothing (module docstring)."""
    z = cfg.beta * (chosen - rejected)
    return -(1 - cfg.label_smoothing) * F.logsigmoid(z) - cfg.label_smoothing * F.logsigmoid(-z)


def robust_loss(chosen: Tensor, rejected: Tensor, _ct: Tensor, _rt: Tensor, cfg: DPOLossConfig) -> Tensor:
    """Robust DPO: unbiased under labels flipped with probability label_smoothing."""
    z, eps = cfg.beta * (chosen - rejected), cfg.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def hinge_loss(chosen: Tensor, rejected: Tensor, _ct: Tensor, _rt: Tensor, cfg: DPOLossConfig) -> Tensor:
    """SLiC's hinge on the scaled log-ratio margin."""
    return torch.relu(1 - cfg.beta * (chosen - rejected))


def ipo_loss(chosen: Tensor, rejected: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor, cfg: DPOLossConfig):
    """IPO's squared loss on length-normalised log-ratios (module docstring)."""
    z = chosen / chosen_tokens.clamp(min=1.0) - rejected / rejected_tokens.clamp(min=1.0)
    return (z - 1 / (2 * cfg.beta)) ** 2


PREFERENCE_LOSSES.register("sigmoid", PreferenceLoss(sigmoid_loss, label_smoothing=True))
PREFERENCE_LOSSES.register("robust", PreferenceLoss(robust_loss, label_smoothing=True, label_smoothing_open=True))
PREFERENCE_LOSSES.register("hinge", PreferenceLoss(hinge_loss))
PREFERENCE_LOSSES.register("ipo", PreferenceLoss(ipo_loss))


@dataclass(frozen=True)
class PairLogps:
    """Summed response log-probs of a batch of pairs, each [B] (reference ones None when reference-free)."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None


def dpo_loss(logps: PairLogps, config: DPOLossConfig, num_pairs: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The configured preference loss: sum over pairs / `num_pairs` (None: the batch's pair count), and the
    detached stats of the module docstring (means over this batch)."""
    if config.reference_free:
        chosen_ratio, rejected_ratio = logps.chosen, logps.rejected
    else:
        if logps.ref_chosen is None or logps.ref_rejected is None:
            raise ValueError("dpo_loss: reference log-probs are missing and dpo.reference_free is false")
        chosen_ratio, rejected_ratio = logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected
    spec = PREFERENCE_LOSSES.get(config.loss_type)
    losses = spec.fn(chosen_ratio, rejected_ratio, logps.chosen_tokens.float(), logps.rejected_tokens.float(), config)
    loss = losses.sum() / (losses.numel() if num_pairs is None else max(num_pairs, 1))
    return loss, preference_stats(chosen_ratio, rejected_ratio, logps, config.beta)


def preference_stats(chosen_ratio: Tensor, rejected_ratio: Tensor, logps: PairLogps, beta: float) -> dict[str, Tensor]:
    """TRL's reward metrics of a batch of pairs (module docstring), detached."""
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": logps.chosen.detach().mean(),
        "logps/rejected": logps.rejected.detach().mean(),
    }
