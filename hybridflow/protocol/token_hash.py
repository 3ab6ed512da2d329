"""Token parity: a hash of the ids the sampler drew, taken where they were drawn, checked before the update.

    hash(ids) = sum over k of ((ids[k] + 1) * g(k) mod M)   (mod M),   M = 2^31 - 1 (a prime),  g(k) = 48271^(k+1) mod M

where k counts the sampled ids in order (0, 1, ...). The same value comes from the list of sampled ids (`hash_ids`,
what a sampler or the agent loop holds) and from (`responses`, `response_mask`) (`hash_rows`, what the trainer
trains: the k-th token that `response_mask` marks is the k-th sampled id), so a row whose trained ids are not the
sampled ones, in that order, almost surely hashes differently. Exactly: changing one id changes the hash
(g(k) is never 0 mod M and ids differ by less than M); so does swapping two different ids (g is injective over
k < M - 1); so does dropping or adding a trailing id, unless that id is M - 1, which no vocabulary reaches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MOD = 2**31 - 1
"""The hash's modulus (a Mersenne prime)."""
_BASE = 48271  # a primitive root mod MOD (MINSTD's multiplier): g(k) differs for every k < MOD - 1
_weights = torch.ones(0, dtype=torch.int64)


def position_weights(count: int) -> Tensor:
    """g(0), ..., g(count - 1) as int64, each in [1, MOD)."""
    global _weights
    if len(_weights) < count:
        out, w = [], 1
        for _ in range(max(count, 2 * len(_weights))):
            w = w * _BASE % MOD
            out.append(w)
        _weights = torch.tensor(out, dtype=torch.int64)
    return _weights[:count]


def hash_ids(ids: Sequence[int] | Tensor) -> int:
    """The hash of one row's sampled ids, in sampling order."""
    t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    terms = (t + 1) % MOD * position_weights(len(t)) % MOD  # each < 2^31: sums of up to 2^32 terms fit int64
    return int(terms.sum() % MOD)


def hash_rows(responses: Tensor, response_mask: Tensor) -> Tensor:
    """[B] int64: the hash of each row's ids where `response_mask` is 1 (the trained ids), in order."""
    mask = response_mask.bool().cpu()
    k = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    terms = (responses.long().cpu() + 1) % MOD * position_weights(responses.shape[-1])[k] % MOD
    return (terms * mask).sum(dim=-1) % MOD


def hash_list_rows(rows: Sequence[Sequence[int]]) -> Tensor:
    """[len(rows)] int64: `hash_ids` of each row."""
    return torch.tensor([hash_ids(r) for r in rows], dtype=torch.int64)


def mismatched_rows(batch_hash: Tensor, responses: Tensor, response_mask: Tensor) -> list[int]:
    """Rows whose trained ids do not hash to the hash taken where they were sampled."""
    trained = hash_rows(responses, response_mask)
    return (trained != batch_hash.cpu().long()).nonzero().flatten().tolist()
