"""3D-HybridEngine resharding: this rank's training shards -> its generation shard, moving only what it lacks.

Training layout: every weight is a DTensor over the engine's mesh (FSDP2's Shard(0) over dp, times
DTensor tensor parallel for the tp engine, Replicate over HSDP replicas), or a plain tensor that
every rank holds whole. A rank's local piece is one block of the full tensor (`held_boxes`). With pipeline
stages a weight lives only on its stage's ranks; the others hold none of it. Who holds which block of every
weight is the plan's `WeightTable` (hybridflow/engine/reshard_plan.py).
Generation layout (`GenerationLayout`): tp groups of `tp` global ranks, consecutive or strided (as the
rollout's `tensor_parallel_group`; `aligned_stride` picks the stride that makes each FSDP shard part of
its generation shard); a split weight is cut into `tp` even chunks along its split dim, group rank i
holding chunk i; every other weight is whole on every rank.

For each weight, each rank's target block is cut by the distinct held blocks; a piece comes from
the rank itself when it holds that block (a cast-copy, nothing on the wire), else from one of the
ranks holding it (chosen by receiver rank, which spreads the load over replicas), by point-to-point
isend/irecv, one packed message per pair of ranks and bucket of weights. Every rank derives the same
plan from the placements alone (under pp, exchanged once per engine: `gathered_table`), so no exchange is
needed to match sends and receives. Pieces land in
the destination tensors (the rollout's own, or new ones); the only other memory is one bucket's
packed send and receive buffers. No rank materialises a full tensor it does not keep whole.

The plain alternative (`Engine.full_state_dict` on every rank, then slice) receives the whole
model on every rank; here a rank receives its generation shard less what it already holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from hybridflow.engine.parallel.dims import aligned_stride, group_coords  # noqa: F401  (re-exported)
from hybridflow.engine.reshard_plan import (  # noqa: F401  (held_boxes, Piece, ...: re-exported)
    Box,
    Piece,
    WeightTable,
    held_boxes,
    local_table,
    plan_pieces,
    split_pieces,
    unique_tensors,
    volume,
)

BUCKET_BYTES = 32 * 2**20
"""Complete the transfers every this many bytes on the wire (all ranks' pieces, in the target dtype):
bounds each rank's send and receive buffers."""


@dataclass(frozen=True)
class GenerationLayout:
    """Generation layout: tp groups of `tp` ranks `stride` apart (1: consecutive ranks; see `tp_index`);
    `split_dims[name]` is the dim that weight is cut along (even chunks, group rank i holds chunk i);
    weights not named stay whole on every rank."""

    tp: int
    split_dims: Mapping[str, int]
    stride: int = 1

    def tp_index(self, rank: int) -> int:
        """Global `rank`'s place in its tp group (see `group_coords`)."""
        return group_coords(rank, self.tp, self.stride)[1]

    def target(self, name: str, shape: tuple[int, ...], rank: int) -> Box:
        """The block of weight `name` (full `shape`) that global `rank` holds for generation."""
        box = [(0, n) for n in shape]
        dim = self.split_dims.get(name)
        if dim is not None and self.tp > 1:
            if shape[dim] % self.tp:
                raise ValueError(f"{name}: dim {dim} of size {shape[dim]} does not split over tp={self.tp}")
            size, i = shape[dim] // self.tp, self.tp_index(rank)
            box[dim] = (i * size, (i + 1) * size)
        return tuple(box)


@dataclass
class ReshardStats:
    """What one reshard moved and allocated on this rank, in bytes."""

    received: int = 0
    sent: int = 0
    local: int = 0
    allocated: int = 0
    """Destination tensors created because no `out` was given (the generation shard, if none was)."""
    peak_buffers: int = 0
    """Most send + receive buffers alive at once."""

    @property
    def peak_extra(self) -> int:
        """Peak bytes this reshard held beyond the training and destination tensors given to it."""
        return self.allocated + self.peak_buffers


def named_weights(module: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter of `module` under each of its names (tied ones repeated, the same object)."""
    return dict(module.named_parameters(remove_duplicate=False))


def block_view(t: Tensor, box: Box, region: Box) -> Tensor:
    """The part of `t` (which holds block `box` of its full tensor) that is `region` of the full tensor."""
    return t[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(region, box))]


@dataclass
class _Bucket:
    """The transfers of one bucket on this rank. Local pieces are copied at once; the pieces for (from)
    each peer are packed into one message per peer and bucket: one isend/irecv pair per peer instead of
    one per piece (gloo over loopback is bound by messages, not bytes, at a few hundred pieces). A bucket
    closes once the wire bytes of ALL ranks' pieces in it reach `bucket_bytes`: the same point on every rank."""

    rank: int
    stats: ReshardStats
    dtype: torch.dtype
    bucket_bytes: int
    filled: int = 0
    tag: int = 0
    sends: dict[int, list[Tensor]] = field(default_factory=dict)
    receives: dict[int, list[Tensor]] = field(default_factory=dict)

    def add(self, p: Piece, local: Tensor | None, own: Box | None, dest: Tensor, dest_box: Box) -> None:
        """Copy `p` if it is local; else queue it if this rank sends (a view of `local`, its block `own`; None where
        this rank holds none of the weight, so sends none of it) or receives it (a view of `dest`), in plan order,
        which both ends of every pair share."""
        if p.src == p.dst:
            if p.src == self.rank:
                block_view(dest, dest_box, p.region).copy_(block_view(local, own, p.region))
                self.stats.local += volume(p.region) * dest.element_size()
            return
        if p.src == self.rank:
            self.sends.setdefault(p.dst, []).append(block_view(local, own, p.region))
        elif p.dst == self.rank:
            self.receives.setdefault(p.src, []).append(block_view(dest, dest_box, p.region))
        self.filled += volume(p.region) * dest.element_size()
        if self.filled >= self.bucket_bytes:
            self.finish()

    def finish(self) -> None:
        """Send and receive the queued pieces (one flat message per peer, cast while packing), place the
        received ones, free the buffers."""
        works, inbox = [], {}
        for dst, views in self.sends.items():
            flat = _pack(views, self.dtype)
            works.append(dist.isend(flat, dst, tag=self.tag))
            self.stats.sent += flat.nbytes
            inbox[-1 - dst] = flat  # kept alive until the send completed
        for src, views in self.receives.items():
            inbox[src] = torch.empty(sum(v.numel() for v in views), dtype=self.dtype, device=views[0].device)
            works.append(dist.irecv(inbox[src], src, tag=self.tag))
        for work in works:
            work.wait()
        self.stats.peak_buffers = max(self.stats.peak_buffers, sum(b.nbytes for b in inbox.values()))
        for src, views in self.receives.items():
            _unpack(inbox[src], views)
            self.stats.received += inbox[src].nbytes
        self.sends, self.receives, self.filled, self.tag = {}, {}, 0, self.tag + 1


def _pack(views: list[Tensor], dtype: torch.dtype) -> Tensor:
    flat = torch.empty(sum(v.numel() for v in views), dtype=dtype, device=views[0].device)
    offset = 0
    for v in views:
        flat[offset : offset + v.numel()].view(v.shape).copy_(v)
        offset += v.numel()
    return flat


def _unpack(flat: Tensor, views: list[Tensor]) -> None:
    offset = 0
    for v in views:
        v.copy_(flat[offset : offset + v.numel()].view(v.shape))
        offset += v.numel()


def local_block(name: str, t: Tensor, box: Box) -> Tensor:
    """This rank's piece of `t`, checked to be the block `box` claims."""
    local = t.detach().to_local() if isinstance(t, DTensor) else t.detach()
    if tuple(local.shape) != tuple(hi - lo for lo, hi in box):
        raise ValueError(
            f"reshard: {name}'s local piece {tuple(local.shape)} is not one block {box} of the full "
            f"tensor (placements {getattr(t, 'placements', None)})"
        )
    return local


def _destination(
    names: tuple[str, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out: Mapping[str, Tensor] | None,
    stats: ReshardStats,
    device: torch.device,
) -> Tensor:
    if out is None:
        dest = torch.empty(shape, dtype=dtype, device=device)
        stats.allocated += dest.nbytes
        return dest
    if names[0] not in out:
        raise KeyError(f"reshard: {names[0]} has no destination tensor; destinations look like {list(out)[:3]}")
    dest = out[names[0]]
    if tuple(dest.shape) != shape or dest.dtype != dtype:
        raise ValueError(
            f"reshard: {names[0]} goes to a {tuple(dest.shape)} {dest.dtype} tensor; its generation "
            f"shard is {shape} {dtype}"
        )
    return dest


@torch.no_grad()
def reshard(
    named: Mapping[str, Tensor],
    layout: GenerationLayout,
    dtype: torch.dtype,
    out: Mapping[str, Tensor] | None = None,
    stats: ReshardStats | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    table: WeightTable | None = None,
) -> dict[str, Tensor]:
    """This rank's generation shard of every weight of the model, in `dtype` (a collective over the default group).
    `named`: name -> this rank's training tensor (DTensor or plain). Pass parameters (`named_weights`), not a state
    dict: FSDP2's state dict wraps a tied parameter in two DTensor objects, which would move it twice.

    `table`: every weight and who holds which block of it, the same on every rank (reshard_plan.py); None reads it
    off `named` (`local_table`: every rank holds every name, the same names in the same order). Pipeline stages,
    whose ranks hold different weights, pass `gathered_table(named, ...)`.
    `out`: name -> destination tensor (the rollout's own, shaped as the shard) to write into; without
    it new tensors are returned. Tied weights are moved once. `stats` is filled with what moved.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    table = table if table is not None else local_table(named, world)
    stats = stats if stats is not None else ReshardStats()
    bucket = _Bucket(rank, stats, dtype, bucket_bytes)
    max_elems = bucket_bytes // torch.empty(0, dtype=dtype).element_size()
    device = next(iter(named.values())).device
    result: dict[str, Tensor] = {}
    late: list[tuple[str, Tensor]] = []
    for spec in table:
        name, own = spec.names[0], spec.held[rank]
        targets = tuple(layout.target(name, spec.shape, r) for r in range(world))
        local = None if own is None else local_block(name, named[name], own)
        dest = _destination(spec.names, tuple(hi - lo for lo, hi in targets[rank]), dtype, out, stats, device)
        for piece in split_pieces(plan_pieces(spec.held, targets), max_elems):
            bucket.add(piece, local, own, dest, targets[rank])
        late += [(n, dest) for n in _alias(spec.names, dest, out, result)]
    bucket.finish()
    for name, dest in late:
        result[name].copy_(dest)
    return result


def _alias(
    names: tuple[str, ...], dest: Tensor, out: Mapping[str, Tensor] | None, result: dict[str, Tensor]
) -> list[str]:
    """Record `dest` under every name of a tied weight; returns the names whose own destination is
    another tensor (to be copied from `dest` once the transfers completed)."""
    late = []
    for name in names:
        if out is not None and name in out and out[name].data_ptr() != dest.data_ptr():
            result[name] = out[name]
            late.append(name)
        else:
            result[name] = dest
    return late
