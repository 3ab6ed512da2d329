"""Next-token selection from a batch of logits: greedy, temperature, top-k, top-p.

The log-prob returned with each token is log softmax(logits / temperature) at that
token, taken BEFORE top-k/top-p filtering (greedy: temperature 1). That is the
quantity the actor recomputes in `compute_log_prob` (it scales by the rollout
temperature and never filters), so rollout and actor log-probs differ only by
engine numerics and can feed off-policy corrections directly. verl's rollouts
report the log-prob of the filtered distribution instead; with top_k = -1 and
top_p = 1 the two definitions coincide.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.rollout.config import SamplingParams


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (order: k, then p).

    The nucleus is the smallest set of most likely tokens whose probability mass
    reaches top_p; the most likely token is always kept.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Pick one token per row of fp32 `logits` [B, V]; returns (tokens [B], log-probs [B])."""
    if not params.do_sample:
        tokens = logits.argmax(dim=-1)
        return tokens, _token_logprob(logits.log_softmax(dim=-1), tokens)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    logp = scaled.log_softmax(dim=-1)
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1) if params.filters else logp.exp()
    tokens = draw(probs, generator)
    return tokens, _token_logprob(logp, tokens)


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of `probs` [B, V] by inverse CDF: B uniforms instead of torch.multinomial's
    B x V exponentials (the latter was the largest single op of a decode step on CPU)."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(len(probs), 1, generator=generator, dtype=cdf.dtype) * cdf[:, -1:]
    # right=True: the first token whose cdf exceeds u, so zero-probability tokens are never drawn
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _token_logprob(logp: Tensor, tokens: Tensor) -> Tensor:
    return logp.gather(-1, tokens[:, None]).squeeze(-1)
