"""3D-HybridEngine resharding: this rank's training shards -> its generation shard, moving only what it lacks.

Training layout: every weight is a DTensor over the engine's mesh (FSDP2's Shard(0) over dp, times
DTensor tensor parallel for the tp engine, Replicate over HSDP replicas), or a plain tensor that
every rank holds whole. A rank's local piece is one block of the full tensor (`held_boxes`).
Generation layout (`GenerationLayout`): tp groups of `tp` global ranks, consecutive or strided (as the
rollout's `tensor_parallel_group`; `aligned_stride` picks the stride that makes each FSDP shard part of
its generation shard); a split weight is cut into `tp` even chunks along its split dim, group rank i
holding chunk i; every other weight is whole on every rank.

For each weight, each rank's target block is cut by the distinct held blocks; a piece comes from
the rank itself when it holds that block (a cast-copy, nothing on the wire), else from one of the
ranks holding it (chosen by receiver rank, which spreads the load over replicas), by point-to-point
isend/irecv, one packed message per pair of ranks and bucket of weights. Every rank derives the same
plan from the placements alone, so no exchange is needed to match sends and receives. Pieces land in
the destination tensors (the rollout's own, or new ones); the only other memory is one bucket's
packed send and receive buffers. No rank materialises a full tensor it does not keep whole.

The plain alternative (`Engine.full_state_dict` on every rank, then slice) receives the whole
model on every rank; here a rank receives its generation shard less what it already holds.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from hybridflow.engine.parallel_dims import aligned_stride, group_coords  # noqa: F401  (re-exported)

Box = tuple[tuple[int, int], ...]
"""A block of a tensor: (start, stop) per dim, in the full tensor's coordinates."""
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


@dataclass(frozen=True)
class Piece:
    """One block of one weight moving from rank `src` to rank `dst` (the same rank: a local copy)."""

    src: int
    dst: int
    region: Box


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


def held_boxes(t: Tensor, world: int, meshes: dict[int, tuple] | None = None) -> tuple[Box, ...]:
    """The block of the full tensor that each global rank < `world` holds of `t` (all of it for a plain
    tensor). `meshes`: a cache of each device mesh's ranks and shape (reading `DeviceMesh.mesh` is slow)."""
    if not isinstance(t, DTensor):
        return (tuple((0, n) for n in t.shape),) * world
    mesh, meshes = t.device_mesh, meshes if meshes is not None else {}
    if id(mesh) not in meshes:
        meshes[id(mesh)] = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape))
    ranks, shape = meshes[id(mesh)]
    return tuple(_held_box(tuple(t.shape), ranks, shape, tuple(t.placements), r) for r in range(world))


@functools.cache
def _held_box(
    shape: tuple[int, ...], ranks: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, rank: int
) -> Box:
    flat, coord = ranks.index(rank), []
    for size in reversed(mesh_shape):
        flat, c = divmod(flat, size)
        coord.insert(0, c)
    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
    return tuple((o, o + n) for o, n in zip(offset, local))


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


@functools.cache
def plan_pieces(held: tuple[Box, ...], targets: tuple[Box, ...]) -> tuple[Piece, ...]:
    """The pieces that give every rank r its `targets[r]` from the blocks `held[r]` (ranks with the same
    block are replicas: a rank takes a block from itself if it can, else from replica number r mod count)."""
    holders: dict[Box, list[int]] = {}
    for rank, box in enumerate(held):
        holders.setdefault(box, []).append(rank)
    pieces = []
    for dst, want in enumerate(targets):
        for box, ranks in holders.items():
            region = _intersect(box, want)
            if region is not None:
                pieces.append(Piece(dst if dst in ranks else ranks[dst % len(ranks)], dst, region))
    return tuple(pieces)


def named_weights(module: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter of `module` under each of its names (tied ones repeated, the same object)."""
    return dict(module.named_parameters(remove_duplicate=False))


def block_view(t: Tensor, box: Box, region: Box) -> Tensor:
    """The part of `t` (which holds block `box` of its full tensor) that is `region` of the full tensor."""
    return t[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(region, box))]


def _volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


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

    def add(self, p: Piece, local: Tensor, own: Box, dest: Tensor, dest_box: Box) -> None:
        """Copy `p` if it is local; else queue it if this rank sends (a view of `local`) or receives it (a view
        of `dest`), in plan order, which both ends of every pair share."""
        if p.src == p.dst:
            if p.src == self.rank:
                block_view(dest, dest_box, p.region).copy_(block_view(local, own, p.region))
                self.stats.local += _volume(p.region) * dest.element_size()
            return
        if p.src == self.rank:
            self.sends.setdefault(p.dst, []).append(block_view(local, own, p.region))
        elif p.dst == self.rank:
            self.receives.setdefault(p.src, []).append(block_view(dest, dest_box, p.region))
        self.filled += _volume(p.region) * dest.element_size()
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


@functools.cache
def split_pieces(pieces: tuple[Piece, ...], max_elems: int) -> tuple[Piece, ...]:
    """`pieces` with every moved piece larger than `max_elems` cut into blocks of rows no larger (so one
    big weight spreads over buckets instead of needing buffers its size)."""
    out = []
    for p in pieces:
        (lo, hi), rest = p.region[0], p.region[1:]
        row = _volume(rest)
        step = hi - lo if p.src == p.dst else max(1, max_elems // max(row, 1))
        out += [Piece(p.src, p.dst, ((r, min(r + step, hi)), *rest)) for r in range(lo, hi, step)]
    return tuple(out)


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


def unique_tensors(named: Mapping[str, Tensor]) -> list[tuple[list[str], Tensor]]:
    """(names, tensor) per distinct tensor object, in first-seen order (tied parameters once)."""
    groups: dict[int, tuple[list[str], Tensor]] = {}
    for name, t in named.items():
        groups.setdefault(id(t), ([], t))[0].append(name)
    return list(groups.values())


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
    names: list[str],
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
) -> dict[str, Tensor]:
    """This rank's generation shard of every weight in `named` (name -> training tensor, DTensor or plain,
    the same names in the same order on every rank: a collective over the default group), in `dtype`.
    Pass parameters (`named_weights`), not a state dict: FSDP2's state dict wraps a tied parameter in
    two DTensor objects, which would move it twice.

    `out`: name -> destination tensor (the rollout's own, shaped as the shard) to write into; without
    it new tensors are returned. Tied weights are moved once. `stats` is filled with what moved.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    stats = stats if stats is not None else ReshardStats()
    bucket = _Bucket(rank, stats, dtype, bucket_bytes)
    max_elems = bucket_bytes // torch.empty(0, dtype=dtype).element_size()
    result: dict[str, Tensor] = {}
    late: list[tuple[str, Tensor]] = []
    meshes: dict[int, tuple] = {}
    for names, t in unique_tensors(named):
        held = held_boxes(t, world, meshes)
        targets = tuple(layout.target(names[0], tuple(t.shape), r) for r in range(world))
        local = local_block(names[0], t, held[rank])
        dest = _destination(names, tuple(hi - lo for lo, hi in targets[rank]), dtype, out, stats, local.device)
        for piece in split_pieces(plan_pieces(held, targets), max_elems):
            bucket.add(piece, local, held[rank], dest, targets[rank])
        late += [(name, dest) for name in _alias(names, dest, out, result)]
    bucket.finish()
    for name, dest in late:
        result[name].copy_(dest)
    return result


def _alias(names: list[str], dest: Tensor, out: Mapping[str, Tensor] | None, result: dict[str, Tensor]) -> list[str]:
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
