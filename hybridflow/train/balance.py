"""Sequence-length balancing across data-parallel workers (verl's `balance_batch`), on the controller.

A worker group hands worker k the k-th consecutive chunk of a batch (Dispatch.DP_COMPUTE_PROTO),
and every step of the update waits for the slowest worker. Generated responses vary in length,
so `balance_batch` reorders the rows first: every chunk keeps the same number of rows and gets
about the same number of real tokens. The n samples of a prompt (one uid) move together, so the
engine's shared-prompt packing (hybridflow/engine/prefix.py) still finds them side by side.
"""

from __future__ import annotations

import torch

from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K


def _units(batch: DataProto, world: int) -> list[list[int]]:
    """Rows grouped by uid (in order of first appearance) when every chunk can take whole groups of
    one size; otherwise one unit per row."""
    groups: dict[str, list[int]] = {}
    uids = batch.non_tensor_batch.get(K.UID)
    if uids is not None:
        for row, uid in enumerate(uids):
            groups.setdefault(str(uid), []).append(row)
    units = list(groups.values())
    sizes = {len(u) for u in units}
    if len(sizes) == 1 and len(units) % world == 0:
        return units
    return [[row] for row in range(len(batch))]


def balanced_order(tokens: list[int], units: list[list[int]], world: int) -> list[list[int]]:
    """Units dealt to `world` chunks of equal unit count, heaviest first onto the lightest chunk that
    has room (LPT with a cardinality cap); each chunk's rows in their original order."""
    per_chunk = len(units) // world
    loads, chunks = [0] * world, [[] for _ in range(world)]
    for unit in sorted(units, key=lambda u: -sum(tokens[r] for r in u)):
        k = min((k for k in range(world) if len(chunks[k]) < per_chunk), key=lambda k: loads[k])
        chunks[k].append(unit)
        loads[k] += sum(tokens[r] for r in unit)
    return [sorted(r for unit in chunk for r in unit) for chunk in chunks]


def balance_batch(batch: DataProto, world: int) -> dict[str, float]:
    """Reorder `batch` in place so each of `world` consecutive chunks carries about equal real tokens.

    Returns the imbalance (largest chunk's tokens over the mean) before and after. A batch that does
    not split into `world` equal chunks is left as it is.
    """
    if world < 2 or len(batch) % world:
        return {}
    tokens = batch.batch[K.ATTENTION_MASK].sum(-1).tolist()
    units = _units(batch, world)
    if len(units) % world:
        return {}
    order = balanced_order(tokens, units, world)
    rows = len(batch) // world
    before = [sum(tokens[k * rows : (k + 1) * rows]) for k in range(world)]
    after = [sum(tokens[r] for r in chunk) for chunk in order]
    batch.reorder(torch.tensor([r for chunk in order for r in chunk]))
    mean = sum(tokens) / world
    return {"perf/dp_token_imbalance_before": max(before) / mean, "perf/dp_token_imbalance": max(after) / mean}
