"""The critic's clipped value loss (config: critic.cliprange_value, critic.loss_agg_mode)."""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algos.core import GlobalNorm, agg_loss, masked_fraction


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_norm: GlobalNorm | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO as in OpenAI baselines; Schulman et al. 2017 uses the unclipped MSE).

    v_clip = V_old + clip(V - V_old, -c, c);  l_t = 0.5 max((V - G)^2, (v_clip - G)^2),
    aggregated by `agg_loss`. Returns (loss, clipfrac) with clipfrac the share of
    valid tokens where the clipped error was larger.
    """
    if cliprange_value <= 0:
        raise ValueError(f"critic.cliprange_value must be > 0, got {cliprange_value}")
    v_clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    err = (vpreds - returns).square()
    err_clipped = (v_clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(err, err_clipped), response_mask, loss_agg_mode, global_norm, norm_length)
    return loss, masked_fraction(err_clipped > err, response_mask)
