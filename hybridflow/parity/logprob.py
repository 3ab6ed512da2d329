"""Log-prob parity: the rollout's log-probs of the sampled tokens against the trainer's, per trained token.

With d = log p_trainer - log p_rollout over the tokens `response_mask` marks:
- gap_mean = mean |d| and gap_max = max |d|, in nats;
- frac_beyond = the fraction of tokens with |exp(d) - 1| > ratio, i.e. whose importance ratio
  p_trainer / p_rollout leaves [1 - ratio, 1 + ratio].
`mismatch/*` (algos/rollout_is.py) reports KL-style averages of the same two tensors when rollout IS is on;
these are the per-token extremes a guard needs, computed every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogprobGaps:
    """The log-prob check's numbers for one step."""

    gap_mean: float
    """Mean |log p_trainer - log p_rollout| per trained token (nats)."""
    gap_max: float
    """Largest |log p_trainer - log p_rollout| of a trained token (nats)."""
    frac_beyond: float
    """Fraction of trained tokens with |p_trainer / p_rollout - 1| > ratio."""
    tokens: int
    """Trained tokens compared."""


def logprob_gaps(trainer: Tensor, rollout: Tensor, mask: Tensor, ratio: float) -> LogprobGaps:
    """The gaps between [B, R] log-probs over the tokens `mask` marks (all zeros when it marks none)."""
    valid = mask.bool()
    d = (trainer.float() - rollout.float())[valid]
    if d.numel() == 0:
        return LogprobGaps(0.0, 0.0, 0.0, 0)
    gap = d.abs()
    beyond = (torch.expm1(d).abs() > ratio).float().mean()
    return LogprobGaps(float(gap.mean()), float(gap.max()), float(beyond), int(d.numel()))
