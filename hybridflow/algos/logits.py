"""Per-token log-probabilities and entropies from logits, with bounded memory.

A [B, R, V] logits tensor for a 50k vocabulary is large; a full
`log_softmax` or `softmax` doubles it. These functions walk the flattened
rows in chunks of `chunk_size` (as views: a sliced input such as
`logits[:, :-1]` is not copied), so the extra memory is one chunk
(chunk_size x V floats), and compute in float32 whatever the logits dtype.

Departures: none in the math. Under autograd, `entropy_from_logits` (and
`logprobs_from_logits` for non-float32 logits, whose float32 upcast would
otherwise be kept) recompute each chunk in backward (activation
checkpointing) instead of keeping per-chunk intermediates alive, so the
memory bound also holds for training. The gradient w.r.t. the logits is
itself [..., V]; that one is unavoidable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 512


def _check_chunk(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _row_blocks(t: Tensor) -> list[Tensor]:
    """2-D views [rows, V] of `t` [..., V] whose concatenation is `t.reshape(-1, V)`, never copying.

    A sliced input (e.g. `logits[:, :-1]`) cannot be flattened as one view; it is split
    along its leading dims until each part can.
    """
    try:
        return [t.view(-1, t.shape[-1])]
    except RuntimeError:
        return [block for sub in t.unbind(0) for block in _row_blocks(sub)]


def _map_chunks(
    fn: Callable[..., Tensor], logits: Tensor, labels: Tensor | None, chunk_size: int, recompute: bool
) -> Tensor:
    """fn(logit rows[, their labels]) over chunks of at most `chunk_size` rows of `logits` [..., V],
    concatenated in flattened order; chunks are checkpointed if asked and grads flow."""
    _check_chunk(chunk_size)
    use_ckpt = recompute and torch.is_grad_enabled() and logits.requires_grad
    flat_labels = labels.reshape(-1) if labels is not None else None
    parts, offset = [], 0
    for block in _row_blocks(logits):
        for i in range(0, block.shape[0], chunk_size):
            chunk = (block[i : i + chunk_size],)
            if flat_labels is not None:
                chunk += (flat_labels[offset + i : offset + i + len(chunk[0])],)
            parts.append(checkpoint(fn, *chunk, use_reentrant=False) if use_ckpt else fn(*chunk))
        offset += block.shape[0]
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def _chunk_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log p(label) = logit[label] - logsumexp(logits), per position.

    logits: [..., V]; labels: [...] int64. Returns float32 [...]. At most
    `chunk_size` rows of the flattened input are processed at once; no
    log-softmax over the whole vocabulary is materialised.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without vocab {tuple(logits.shape[:-1])}"
        )
    # fp32 logits: logsumexp keeps only a view of its input for backward; other
    # dtypes would keep a float32 copy per chunk, so recompute it instead.
    recompute = logits.dtype != torch.float32
    return _map_chunks(_chunk_logprobs, logits, labels, chunk_size, recompute).reshape(labels.shape)


def logprobs_from_hidden(
    hidden: Tensor, head: Callable[[Tensor], Tensor], labels: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """log p(label) from final hidden states [N, H] through `head` (the LM head), `chunk_size` rows at a time.

    Only the chunk's logits exist at once when gradients are off; with gradients on, each chunk's logits stay
    for backward (a caller passes only the rows it differentiates). Returns float32 [N].
    """
    if hidden.shape[:-1] != labels.shape or hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, H] with labels [N], got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    _check_chunk(chunk_size)
    parts = [
        _chunk_logprobs(head(hidden[i : i + chunk_size]), labels[i : i + chunk_size])
        for i in range(0, hidden.shape[0], chunk_size)
    ]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _chunk_entropy(logits: Tensor) -> Tensor:
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return lse - (probs * logits).sum(dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy of softmax(logits) per position: H = logsumexp(z) - sum_v p_v z_v.

    logits: [..., V]; returns float32 [...]. Processed `chunk_size` rows at
    a time; with gradients enabled each chunk is checkpointed so its softmax
    is not kept for backward.
    """
    return _map_chunks(_chunk_entropy, logits, None, chunk_size, True).reshape(logits.shape[:-1])
