"""Masked reductions and loss aggregation: the arithmetic every algorithm shares.

Conventions (all of hybridflow/algos):
- A mask is read as boolean: an entry counts iff it is non-zero. Padded
  entries never enter a result, even when they hold NaN or inf, because
  values are selected with `torch.where`, never multiplied by the mask.
- Empty selections give 0, never NaN (a mean over zero entries is 0, the
  variance of fewer than two entries is 0).

Departures from common practice:
- `masked_var(unbiased=True)` returns the biased (= 0) variance for a single
  valid entry instead of raising; whitening one token then yields 0.
- `agg_loss` counts a sequence only if it has at least one valid token, so
  rows that are pure padding do not dilute the "seq-mean-*" modes.

THE GLOBAL-NORMALISATION CONTRACT (read this before touching the engine)
------------------------------------------------------------------------
A mini-batch is split over `dp_size` data-parallel ranks and, on each rank,
into micro-batches. With `GlobalNorm(num_tokens, num_seqs, dp_size)` holding
the valid-token / valid-sequence counts of the WHOLE mini-batch (all ranks),
`agg_loss` returns for each micro-batch

    loss_mb = (sum of the micro-batch's per-token or per-seq terms) / global_count * dp_size

The engine must call backward on each `loss_mb` exactly as returned (no
division by the number of micro-batches, no other scaling) and let the
gradients accumulate; FSDP/DDP then AVERAGE gradients over the dp ranks.
Sum over micro-batches and average over ranks gives exactly the global
token-mean (or seq-mean) of the mini-batch, however unevenly tokens fall
into micro-batches. Without `global_norm` each micro-batch is normalised by
its own counts, and the caller owns any further scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridflow.utils.registry import Registry


def _valid(mask: Tensor) -> Tensor:
    return mask.bool() if mask.dtype != torch.bool else mask


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is non-zero: sum_i [m_i != 0] x_i.

    Padded entries are replaced by 0 before summing, so NaN/inf padding is harmless.
    """
    picked = torch.where(_valid(mask), values, torch.zeros_like(values))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def _count(mask: Tensor, dim: int | None) -> Tensor:
    valid = _valid(mask)
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over valid entries: sum_i m_i x_i / sum_i m_i; 0 where nothing is valid."""
    count = _count(mask, dim).clamp(min=1).to(values.dtype)
    return masked_sum(values, mask, dim) / count


def masked_fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Detached share of valid entries where `flags` is true (a clip-fraction stat); 0 where nothing is valid."""
    return masked_mean(flags.float(), mask).detach()


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True, dim: int | None = None) -> Tensor:
    """Variance over valid entries, with Bessel's correction n/(n-1) when `unbiased`.

    var = sum_i m_i (x_i - mean)^2 / (n - 1)  (or / n). Fewer than two valid
    entries give the biased value (0 for one entry, 0 for none).
    """
    mean = masked_mean(values, mask, dim)
    centred = values - (mean if dim is None else mean.unsqueeze(dim))
    n = _count(mask, dim).to(values.dtype)
    sq = masked_sum(centred.square(), mask, dim)
    denom = torch.where(n > 1, n - 1, n) if unbiased else n
    return sq / denom.clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise valid entries to zero mean and unit variance: (x - mean) / sqrt(var + eps).

    Statistics use all valid entries of the tensor (unbiased variance). With
    `shift_mean=False` the mean is added back (only the scale changes).
    Padded entries of the result are 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(_valid(mask), out, torch.zeros_like(out))


@dataclass(frozen=True)
class GlobalNorm:
    """Counts of the whole mini-batch over all data-parallel ranks (see module docstring).

    Build it from all-reduced counts; this module never communicates.
    """

    num_tokens: int
    """Valid (mask != 0) response tokens in the mini-batch, summed over all dp ranks."""
    num_seqs: int
    """Sequences with at least one valid token in the mini-batch, summed over all dp ranks."""
    dp_size: int
    """Number of data-parallel ranks whose gradients the engine averages."""

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"GlobalNorm.dp_size must be >= 1, got {self.dp_size}")
        if self.num_tokens < 0 or self.num_seqs < 0:
            raise ValueError(
                f"GlobalNorm counts must be >= 0, got num_tokens={self.num_tokens}, num_seqs={self.num_seqs}"
            )
        if self.num_tokens < self.num_seqs:
            raise ValueError(
                f"GlobalNorm.num_tokens ({self.num_tokens}) < num_seqs ({self.num_seqs}): every counted "
                "sequence has at least one valid token; pass token and sequence counts of the same mini-batch"
            )

    @classmethod
    def from_mask(cls, response_mask: Tensor, dp_size: int = 1) -> GlobalNorm:
        """Counts of `response_mask` taken as the whole mini-batch (e.g. on the controller)."""
        valid = _valid(response_mask)
        return cls(int(valid.sum()), int(valid.any(dim=-1).sum()), dp_size)


LossAggFn = Callable[[Tensor, Tensor, "GlobalNorm | None", "int | float | None"], Tensor]
"""(loss_mat [B, R], valid [B, R] bool, global_norm, norm_length) -> scalar loss: one loss aggregation mode.
With `global_norm` the count is the global one and the result is multiplied by dp_size (module docstring)."""

LOSS_AGG_MODES: Registry[LossAggFn] = Registry(
    "loss aggregation mode",
    "loss_agg_mode",
    "chosen by actor.loss_agg_mode and critic.loss_agg_mode; add one with LOSS_AGG_MODES.register(name, fn)",
)
"""Loss aggregation modes by name (see `agg_loss`)."""


def _normalise(total: Tensor, count: Tensor | int, like: Tensor, global_norm: GlobalNorm | None) -> Tensor:
    scale = 1 if global_norm is None else global_norm.dp_size
    count_t = torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)
    return total / count_t * scale


def _seq_mean(row_values: Tensor, valid: Tensor, like: Tensor, global_norm: GlobalNorm | None) -> Tensor:
    count = valid.any(dim=-1).sum() if global_norm is None else global_norm.num_seqs
    return _normalise(row_values.sum(), count, like, global_norm)


@LOSS_AGG_MODES.register("token-mean")
def token_mean(loss_mat: Tensor, valid: Tensor, global_norm: GlobalNorm | None, norm_length: float | None) -> Tensor:
    """sum_{i,t} l_it / N (DAPO, Yu et al. 2025)."""
    count = valid.sum() if global_norm is None else global_norm.num_tokens
    return _normalise(masked_sum(loss_mat, valid), count, loss_mat, global_norm)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: Tensor, valid: Tensor, global_norm: GlobalNorm | None, norm_length: float | None
) -> Tensor:
    """sum_i (sum_t l_it) / S."""
    return _seq_mean(masked_sum(loss_mat, valid, dim=-1), valid, loss_mat, global_norm)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: Tensor, valid: Tensor, global_norm: GlobalNorm | None, norm_length: float | None
) -> Tensor:
    """sum_i (sum_t l_it / n_i) / S (GRPO, Shao et al. 2024)."""
    rows = masked_sum(loss_mat, valid, dim=-1) / valid.sum(dim=-1).clamp(min=1).to(loss_mat.dtype)
    return _seq_mean(rows, valid, loss_mat, global_norm)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor, valid: Tensor, global_norm: GlobalNorm | None, norm_length: float | None
) -> Tensor:
    """sum_i (sum_t l_it / norm_length) / S (Dr.GRPO, Liu et al. 2025); norm_length None: the padded width."""
    rows = masked_sum(loss_mat, valid, dim=-1) / float(loss_mat.shape[-1] if norm_length is None else norm_length)
    return _seq_mean(rows, valid, loss_mat, global_norm)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    global_norm: GlobalNorm | None = None,
    norm_length: int | float | None = None,
) -> Tensor:
    """Reduce a [B, R] per-token loss to a scalar with the mode registered as `loss_agg_mode`.

    With n_i valid tokens in row i, S valid rows and N = sum_i n_i:
    - "token-mean":              sum_{i,t} l_it / N                      (DAPO, Yu et al. 2025)
    - "seq-mean-token-sum":      sum_i (sum_t l_it) / S
    - "seq-mean-token-mean":     sum_i (sum_t l_it / n_i) / S            (GRPO, Shao et al. 2024)
    - "seq-mean-token-sum-norm": sum_i (sum_t l_it / norm_length) / S    (Dr.GRPO, Liu et al. 2025)
    `norm_length` is a constant, normally the configured max response length
    (default: loss_mat.shape[-1], which differs between micro-batches only if
    they are padded differently). With `global_norm`, N and S are the global
    counts and the result is multiplied by dp_size (module docstring).
    """
    return LOSS_AGG_MODES.get(loss_agg_mode)(loss_mat, _valid(loss_mask), global_norm, norm_length)
