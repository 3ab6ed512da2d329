"""The service's training forward: each datum's log-probs of its target tokens under the active adapter.

Three things keep it close to the training engine's cost on the same batch:
- Shared prompts. A forward_backward batch of an RL recipe holds several samples of each prompt, and the
  tokens before a datum's first differentiated position (`grads`) are its prompt. Datums with the same prompt run
  it once: a prompt pass over the distinct prompts (left-padded) fills a KV cache, and continuation passes run
  every datum's remaining tokens (right-padded) against its prompt's rows of that cache. The continuations go
  in buckets of similar length (`length_buckets`), so short ones are not padded to the longest. Gradients flow
  back through the cache into the shared prompt, summed over its datums, as they would from separate rows. Used
  where some prompt is shared; otherwise one padded pass runs every datum whole.
- The LM head only where it is needed, in chunks: with autograd for the differentiated tokens, without it for
  the rest (their log-probs are still returned), once per shared prompt position, never over padding. A model
  whose logits are not `head(decoder(...))` (a softcap or scale between them: `head_splits` says) runs the full
  forward instead.
- SDPA's math kernel for passes at most MATH_ATTENTION_MAX_LEN wide, as the training engine does on CPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from hybridflow.algos.logits import logprobs_from_hidden, logprobs_from_logits
from hybridflow.engine.batch import position_ids_from_mask
from hybridflow.engine.config import EngineConfig
from hybridflow.service.wire import Datum

MAX_BATCH_TOKENS = 2048
"""Most padded tokens one forward pass of a forward_backward call holds (longer batches run in parts): with the
head on every token, its fp32 logits take MAX_BATCH_TOKENS x vocab x 4 bytes (400 MB at SmolLM2's 49152)."""
MATH_ATTENTION_MAX_LEN = EngineConfig.cpu_math_attention_max_len
"""Passes at most this wide run SDPA's math kernel on CPU (its backward is the faster one there)."""
PASS_COST_TOKENS = 8
"""What one more continuation pass costs, in padded tokens (its per-layer overhead), when bucketing."""


def target_logprobs(
    lm: nn.Module, data: list[Datum], grads: list[Tensor] | None = None, split_head: bool = True
) -> list[Tensor]:
    """Each datum's float32 log-probs [T] of its target tokens under `lm` (a causal LM, adapters applied); with
    `grads` (a bool [T] per datum) and autograd on, only the marked tokens' log-probs carry gradients."""
    lengths = [len(d.tokens) for d in data]
    labels = torch.cat([torch.from_numpy(np.asarray(d.inputs["target_tokens"], dtype=np.int64)) for d in data])
    if not split_head:
        return _full_forward(lm, data, labels, lengths)
    differentiate = grads is not None and torch.is_grad_enabled()
    plan = SharedPrompts.plan(data, grads) if differentiate else None
    rows, where = _shared_hidden(lm, data, plan) if plan is not None else _padded_hidden(lm, data)
    head = lm.get_output_embeddings()
    if not differentiate:
        return list(_logprobs_at(rows, where, labels, head).split(lengths))
    marked = torch.cat(grads)
    rest, chosen = (~marked).nonzero().squeeze(-1), marked.nonzero().squeeze(-1)
    logps = torch.zeros(len(labels))
    with torch.no_grad():
        logps[rest] = _logprobs_at(rows, where[rest], labels[rest], head)
    logps = logps.index_put((chosen,), logprobs_from_hidden(rows[where[chosen]], head, labels[chosen]))
    return list(logps.split(lengths))


def _logprobs_at(rows: Tensor, where: Tensor, labels: Tensor, head: nn.Module, chunk: int = 512) -> Tensor:
    """log p(labels[i]) from hidden row `rows[where[i]]`, without autograd: the head and logsumexp run once per
    distinct row (a shared prompt position serves every datum of its prompt), `chunk` rows at a time."""
    distinct, inverse = where.unique(return_inverse=True)
    out = torch.empty(len(where))
    for start in range(0, len(distinct), chunk):
        logits = head(rows[distinct[start : start + chunk]]).float()
        lse = logits.logsumexp(-1)
        sel = ((inverse >= start) & (inverse < start + chunk)).nonzero().squeeze(-1)
        local = inverse[sel] - start
        out[sel] = logits[local, labels[sel]] - lse[local]
    return out


@torch.no_grad()
def head_splits(lm: nn.Module) -> bool:
    """Whether `lm`'s logits equal its head applied to its decoder's output (checked on a few tokens)."""
    head, decoder = lm.get_output_embeddings(), lm.get_decoder()
    if head is None or decoder is None or decoder is lm:
        return False
    ids = torch.arange(8)[None] % int(lm.config.vocab_size)
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    return torch.allclose(head(hidden), lm(input_ids=ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)


def batch_parts(data: list[Datum], budget: int = MAX_BATCH_TOKENS) -> list[list[Datum]]:
    """Consecutive runs of datums whose padded size (rows x longest) stays within `budget` tokens."""
    parts: list[list[Datum]] = [[]]
    for d in data:
        run = parts[-1]
        width = max([len(d.tokens), *(len(x.tokens) for x in run)])
        if run and width * (len(run) + 1) > budget:
            parts.append([d])
        else:
            run.append(d)
    return parts


@dataclass
class SharedPrompts:
    """How a batch splits into distinct prompts and per-datum continuations."""

    splits: list[int]
    """Per datum: its prompt's length (the tokens before it that no loss differentiates), at least 1."""
    prompts: list[np.ndarray]
    """The distinct prompts, in order of first appearance."""
    group: list[int]
    """Per datum: the index of its prompt."""

    @classmethod
    def plan(cls, data: list[Datum], grads: list[Tensor]) -> SharedPrompts | None:
        """The split at each datum's first differentiated token (or its last token); None unless some prompt is
        shared or where a datum's first token is differentiated (no prompt to share)."""
        splits = []
        for d, g in zip(data, grads):
            first = g.nonzero()
            splits.append(int(first[0]) if len(first) else len(d.tokens) - 1)
        if min(splits) < 1:
            return None
        index: dict[bytes, int] = {}
        prompts, group = [], []
        for d, k in zip(data, splits):
            key = d.tokens[:k].tobytes()
            if key not in index:
                index[key] = len(prompts)
                prompts.append(d.tokens[:k])
            group.append(index[key])
        return cls(splits, prompts, group) if len(prompts) < len(data) else None


def _shared_hidden(lm: nn.Module, data: list[Datum], plan: SharedPrompts) -> tuple[Tensor, Tensor]:
    """Hidden states [U, H] of each distinct prompt position and each continuation token, and for every datum
    position (in datum order) the row that holds it (module docstring: shared prompts)."""
    decoder = lm.get_decoder()
    ids, mask = _padded(plan.prompts, left=True)
    width = ids.shape[1]
    with _attention_kernel(width):
        prompt = decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True)
    real = mask.bool()
    parts = [prompt.last_hidden_state[real]]  # each prompt's tokens, prompt after prompt
    prompt_start = (real.sum(1).cumsum(0) - real.sum(1)).tolist()
    stash = [(layer.keys, layer.values) for layer in prompt.past_key_values.layers]
    rest = [d.tokens[k:] for d, k in zip(data, plan.splits)]
    cont_row: dict[int, Tensor] = {}
    offset = int(real.sum())
    for bucket in length_buckets([len(r) for r in rest]):
        groups = torch.tensor([plan.group[i] for i in bucket])
        cache = DynamicCache(config=lm.config)
        for layer, (k, v) in enumerate(stash):
            cache.update(k[groups], v[groups], layer)
        r_ids, r_mask = _padded([rest[i] for i in bucket])
        r_width = r_ids.shape[1]
        positions = torch.tensor([plan.splits[i] for i in bucket])[:, None] + torch.arange(r_width)[None]
        with _attention_kernel(width + r_width):
            cont = decoder(
                input_ids=r_ids,
                attention_mask=torch.cat([mask[groups], r_mask], dim=1),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        parts.append(cont.last_hidden_state[r_mask.bool()])
        for i in bucket:
            cont_row[i] = torch.arange(offset, offset + len(rest[i]))
            offset += len(rest[i])
    where = [
        torch.cat([torch.arange(prompt_start[g], prompt_start[g] + k), cont_row[i]])
        for i, (g, k) in enumerate(zip(plan.group, plan.splits))
    ]
    return torch.cat(parts), torch.cat(where)


def length_buckets(lengths: list[int], pass_cost: int = PASS_COST_TOKENS) -> list[list[int]]:
    """Indices of `lengths` in buckets, each run as one right-padded pass: the split of the sorted lengths into
    consecutive runs that pads the fewest tokens, counting `pass_cost` tokens per pass."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sizes = [lengths[i] for i in order]
    best = [0] + [1 << 60] * len(sizes)  # best[j]: the cost of the first j sorted lengths
    cut = [0] * (len(sizes) + 1)
    for j in range(1, len(sizes) + 1):
        for i in range(j):
            cost = best[i] + sizes[j - 1] * (j - i) + pass_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], len(sizes)
    while j > 0:
        buckets.append(order[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


def _padded_hidden(lm: nn.Module, data: list[Datum]) -> tuple[Tensor, Tensor]:
    """Final hidden states [N, H] of every datum's tokens from one right-padded pass, in datum order, and the
    identity map of datum positions to them."""
    ids, mask = _padded([d.tokens for d in data])
    with _attention_kernel(ids.shape[1]):
        hidden = lm.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    rows = hidden[mask.bool()]
    return rows, torch.arange(len(rows))


def _full_forward(lm: nn.Module, data: list[Datum], labels: Tensor, lengths: list[int]) -> list[Tensor]:
    """The model's own forward on every position (for a model whose head does not split off)."""
    ids, mask = _padded([d.tokens for d in data])
    with _attention_kernel(ids.shape[1]):
        logits = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()]
    return list(logprobs_from_logits(logits, labels).split(lengths))


def _padded(seqs: list[np.ndarray], left: bool = False) -> tuple[Tensor, Tensor]:
    """Token ids [n, longest] and their attention mask, each sequence padded on the right (or the left)."""
    width = max(len(t) for t in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, t in enumerate(seqs):
        cols = slice(width - len(t), width) if left else slice(0, len(t))
        ids[r, cols] = torch.from_numpy(t)
        mask[r, cols] = 1
    return ids, mask


def _attention_kernel(width: int):
    """SDPA's math kernel for passes at most MATH_ATTENTION_MAX_LEN wide (module docstring); else the default."""
    return sdpa_kernel([SDPBackend.MATH]) if width <= MATH_ATTENTION_MAX_LEN else nullcontext()
