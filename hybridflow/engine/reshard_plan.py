"""The 3D-HybridEngine reshard's plan: which rank holds which block of every weight, and which pieces move.

A `WeightTable` describes the training layout the same way on every rank: per weight (tied names together) its
full shape and the block each global rank holds (`held_boxes`), or None where a rank holds none of it. Every rank
derives the same `plan_pieces` from it, so sends and receives match without any exchange during the reshard.

- One whole-model training layout (FSDP2 dp x tp, HSDP, plain tensors: every rank holds some block of every
  weight): each rank reads the table off its own weights' placements (`local_table`); no collective.
- Pipeline stages: a weight lives only on the ranks of its stage, so the others cannot read its placements.
  `gathered_table` exchanges each rank's names, shapes and own blocks once (one `all_gather_object` of metadata,
  no tensors); the layout never changes, so the caller keeps the table for the engine's life (rollout/sync.py).
  Tied embeddings: the first stage holds the embedding, the last its own copy as the LM head (pipeline_stage.py);
  the two copies stay equal, and the table takes the first stage's copy under both names (`aliases`), as the full
  gather (`Engine.full_state_dict`) loads it, so the LM head's copy is never moved.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

Box = tuple[tuple[int, int], ...]
"""A block of a tensor: (start, stop) per dim, in the full tensor's coordinates."""


@dataclass(frozen=True)
class Piece:
    """One block of one weight moving from rank `src` to rank `dst` (the same rank: a local copy)."""

    src: int
    dst: int
    region: Box


@dataclass(frozen=True)
class WeightSpec:
    """One weight of the training layout, as every rank sees it."""

    names: tuple[str, ...]
    """Its names (tied weights: several); ranks that hold it have it under names[0]."""
    shape: tuple[int, ...]
    """The full tensor's shape."""
    held: tuple[Box | None, ...]
    """Per global rank: the block of the full tensor it holds, None where it holds none (another pipeline stage's)."""


WeightTable = tuple[WeightSpec, ...]
"""Every weight of the model, in the same order on every rank."""


def unique_tensors(named: Mapping[str, Tensor]) -> list[tuple[list[str], Tensor]]:
    """(names, tensor) per distinct tensor object, in first-seen order (tied parameters once)."""
    groups: dict[int, tuple[list[str], Tensor]] = {}
    for name, t in named.items():
        groups.setdefault(id(t), ([], t))[0].append(name)
    return list(groups.values())


def held_boxes(t: Tensor, world: int, meshes: dict[int, tuple] | None = None) -> tuple[Box | None, ...]:
    """The block of the full tensor that each global rank < `world` holds of `t` (all of it for a plain tensor;
    None for a rank outside a DTensor's mesh). `meshes`: a cache of each device mesh's ranks and shape (reading
    `DeviceMesh.mesh` is slow)."""
    if not isinstance(t, DTensor):
        return (tuple((0, n) for n in t.shape),) * world
    mesh, meshes = t.device_mesh, meshes if meshes is not None else {}
    if id(mesh) not in meshes:
        meshes[id(mesh)] = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape))
    ranks, shape = meshes[id(mesh)]
    placements = tuple(t.placements)
    return tuple(_held_box(tuple(t.shape), ranks, shape, placements, r) if r in ranks else None for r in range(world))


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


def local_table(named: Mapping[str, Tensor], world: int) -> WeightTable:
    """The table of `named` when every rank holds some block of every weight (no pipeline stages): read off this
    rank's own tensors, the same on every rank; no collective."""
    meshes: dict[int, tuple] = {}
    return tuple(
        WeightSpec(tuple(names), tuple(t.shape), held_boxes(t, world, meshes)) for names, t in unique_tensors(named)
    )


def gathered_table(named: Mapping[str, Tensor], aliases: Mapping[str, str] | None = None) -> WeightTable:
    """The table of every weight any rank holds, each rank giving the names, shape and own block of its weights in
    one `all_gather_object` (a collective over the default group; metadata only). `aliases`: name -> the name
    whose weight it is a copy of (tied: {"lm_head.weight": "model.embed_tokens.weight"}), see `merge_tables`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes: dict[int, tuple] = {}
    mine = [(tuple(names), tuple(t.shape), held_boxes(t, world, meshes)[rank]) for names, t in unique_tensors(named)]
    parts: list[list | None] = [None] * world
    dist.all_gather_object(parts, mine)
    return merge_tables(parts, aliases or {})


def merge_tables(parts: Sequence[Sequence[tuple]], aliases: Mapping[str, str]) -> WeightTable:
    """One table from each rank's [(names, shape, own block)], weights in first-seen order over ranks 0, 1, ...
    A weight known under an alias (a copy of another weight) joins that weight's names; the copy is not a source:
    only the ranks holding the weight itself are."""
    names: dict[str, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    held: dict[str, list[Box | None]] = {}
    for rank, part in enumerate(parts):
        for weight_names, shape, box in part:
            key = aliases.get(weight_names[0], weight_names[0])
            if shapes.setdefault(key, tuple(shape)) != tuple(shape):
                raise ValueError(f"reshard: ranks disagree on the shape of {key}: {shapes[key]} and {tuple(shape)}")
            names.setdefault(key, [key])
            names[key] += [n for n in weight_names if n not in names[key]]
            if key in weight_names:  # the weight itself, not a copy under an alias
                held.setdefault(key, [None] * len(parts))[rank] = box
    missing = [key for key in names if key not in held]
    if missing:
        raise ValueError(f"reshard: no rank holds {missing[:3]} itself (only copies under {sorted(aliases)})")
    return tuple(WeightSpec(tuple(names[k]), shapes[k], tuple(held[k])) for k in names)


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


@functools.cache
def plan_pieces(held: tuple[Box | None, ...], targets: tuple[Box, ...]) -> tuple[Piece, ...]:
    """The pieces that give every rank r its `targets[r]` from the blocks `held[r]` (None: rank r holds none; ranks
    with the same block are replicas: a rank takes a block from itself if it can, else from replica number
    r mod count)."""
    holders: dict[Box, list[int]] = {}
    for rank, box in enumerate(held):
        if box is not None:
            holders.setdefault(box, []).append(rank)
    pieces = []
    for dst, want in enumerate(targets):
        for box, ranks in holders.items():
            region = _intersect(box, want)
            if region is not None:
                pieces.append(Piece(dst if dst in ranks else ranks[dst % len(ranks)], dst, region))
    return tuple(pieces)


def volume(box: Box) -> int:
    """Elements in `box`."""
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


@functools.cache
def split_pieces(pieces: tuple[Piece, ...], max_elems: int) -> tuple[Piece, ...]:
    """`pieces` with every moved piece larger than `max_elems` cut into blocks of rows no larger (so one
    big weight spreads over buckets instead of needing buffers its size)."""
    out = []
    for p in pieces:
        (lo, hi), rest = p.region[0], p.region[1:]
        row = volume(rest)
        step = hi - lo if p.src == p.dst else max(1, max_elems // max(row, 1))
        out += [Piece(p.src, p.dst, ((r, min(r + step, hi)), *rest)) for r in range(lo, hi, step)]
    return tuple(out)
