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

DRAW_BLOCK = 1024
"""Tokens per block of the two-level draw (about sqrt(V) keeps both cumulative sums short)."""


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
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None, uniforms: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Pick one token per row of fp32 `logits` [B, V]; returns (tokens [B], log-probs [B]). A draw takes its two
    uniforms per row from `generator`, or from `uniforms` [B, 2] where given (each row's own stream: `row_uniforms`)."""
    if not params.do_sample:
        tokens = logits.argmax(dim=-1)
        return tokens, _token_logprob(logits.log_softmax(dim=-1), tokens)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    probs = scaled.softmax(dim=-1)
    drawn_from = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1) if params.filters else probs
    tokens = draw(drawn_from, generator, uniforms=uniforms)
    # log of the unfiltered probability: a drawn token's probability is > 0, so no -inf; one B x V pass
    # fewer than log_softmax followed by exp
    return tokens, _token_logprob(probs, tokens).log()


def draw(
    probs: Tensor, generator: torch.Generator | None, block: int = DRAW_BLOCK, uniforms: Tensor | None = None
) -> Tensor:
    """One token per row of `probs` [B, V] (unnormalised is fine) by inverse CDF, in two levels:
    a block of `block` tokens by the blocks' masses, then a token inside it by a second uniform.

    B x 2 uniforms instead of `torch.multinomial`'s B x V exponentials, and a cumulative sum over
    V / block block masses plus one block instead of over all V tokens (the cumsum over SmolLM2's
    49k vocabulary was the largest sampling op of a CPU decode step). The chosen block has mass
    > 0 and so does the chosen token, so zero-probability tokens are never drawn. `uniforms` [B, 2]: the two
    uniforms of each row, instead of drawing them from `generator`.
    """
    rows, vocab = probs.shape
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, block - vocab % block))
    blocks = probs.view(rows, -1, block)
    u = (None, None) if uniforms is None else (uniforms[:, :1], uniforms[:, 1:])
    block_id = _inverse_cdf(blocks.sum(dim=-1), generator, u[0])
    inner = blocks[torch.arange(rows), block_id]
    return (block_id * block + _inverse_cdf(inner, generator, u[1])).clamp_(max=vocab - 1)


def row_uniforms(generators: list[torch.Generator]) -> Tensor:
    """[B, 2] uniforms for one draw of B rows, row i's from `generators[i]`: a row's samples then depend on its own
    seed only, not on which other rows share its batch (the turn engine's rows come and go: rollout/native/turns.py)."""
    return torch.stack([torch.rand(2, generator=g) for g in generators])


def _inverse_cdf(weights: Tensor, generator: torch.Generator | None, u: Tensor | None = None) -> Tensor:
    """One index per row of non-negative `weights` [B, N], with probability proportional to its weight (`u` [B, 1]:
    the uniforms, else drawn from `generator`)."""
    cdf = weights.cumsum(dim=-1)
    if u is None:
        u = torch.rand(len(weights), 1, generator=generator, dtype=cdf.dtype)
    u = u.to(cdf.dtype) * cdf[:, -1:]
    # right=True: the first index whose cdf exceeds u, so zero-weight indices are never picked
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def _token_logprob(values: Tensor, tokens: Tensor) -> Tensor:
    return values.gather(-1, tokens[:, None]).squeeze(-1)
