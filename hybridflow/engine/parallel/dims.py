"""Every parallel layout of a worker set in one place: sizes, named mesh axes, rank <-> coordinates.

Training layout (`ParallelDims`). The world is laid out as pp x dp x sp x tp, tp fastest:

    rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank

- dp: groups that hold distinct rows of the batch (the N-D dispatch splits over them);
- sp: Ulysses sequence parallel, the ranks of a dp group that split each micro-batch's tokens;
- tp: tensor parallel, the ranks that split each decoder layer's projections;
- pp: pipeline parallel, the stages that each hold a contiguous slice of the decoder layers
  (engine/parallel/pipeline.py); the pp ranks of one (dp, sp, tp) slot hold the same rows.

FSDP2 shards parameters over the dp x sp ranks of each (pp, tp) slot (the sp ranks train on the same
rows, so they average gradients like dp ranks), split by `engine.fsdp_size` into
dp_replicate x dp_shard (HSDP: shard within a group of dp_shard consecutive dp x sp ranks,
all-reduce across the dp_replicate groups). So dp_replicate * dp_shard == dp * sp; a dp_shard
smaller than sp is allowed (the CPU default fsdp_size 1 replicates everything). torchtitan folds
its context-parallel ranks into the FSDP shard axis instead (dp_shard_cp); we keep fsdp_size
free of sp so layouts and checkpoints from before sp existed read the same.

Generation layout (`GenerationDims`): the rollout's tp groups of `tp` ranks `stride` apart, the
world laid out as (outer, tp, stride), stride fastest; the dp index of a rank is
outer * stride + inner. `aligned_stride` picks the stride that puts every rank's FSDP rows inside
its generation shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelSizes(Protocol):
    """The sizes a layout is built from: an `EngineConfig` (engine/config.py) has them."""

    tensor_parallel_size: int
    ulysses_sequence_parallel_size: int
    pipeline_model_parallel_size: int
    fsdp_size: int | None


class Axis(str, Enum):
    """Names of the device mesh axes (`DeviceMesh.mesh_dim_names`)."""

    PP = "pp"
    DP = "dp"
    SP = "sp"
    TP = "tp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    OUTER = "outer"
    INNER = "inner"


@dataclass(frozen=True)
class Coords:
    """A rank's place in the training layout."""

    pp: int
    dp: int
    sp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of one role's training layout; build with `from_config` (validated there)."""

    dp_replicate: int
    """FSDP replica groups (HSDP): gradients all-reduced across them."""
    dp_shard: int
    """Ranks each parameter is sharded over by FSDP2 (the resolved `engine.fsdp_size`)."""
    tp: int = 1
    """Tensor-parallel ranks (`engine.tensor_parallel_size`)."""
    sp: int = 1
    """Ulysses sequence-parallel ranks (`engine.ulysses_sequence_parallel_size`)."""
    pp: int = 1
    """Pipeline stages (`engine.pipeline_model_parallel_size`)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "sp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} must be >= 1, got {getattr(self, name)}")
        if (self.dp_replicate * self.dp_shard) % self.sp:
            raise ValueError(
                f"dp_replicate x dp_shard ({self.dp_replicate} x {self.dp_shard}) must be a multiple of sp ({self.sp})"
            )

    # --- construction ----------------------------------------------------------
    @classmethod
    def from_config(
        cls, cfg: ParallelSizes, world: int, device: torch.device | str = "cpu", section: str = "engine."
    ) -> ParallelDims:
        """The layout of `cfg` over `world` ranks; `device` resolves fsdp_size None (1 on CPU, all on GPU).
        Raises ValueError naming `section`'s keys ("actor.engine.", ...) when a size does not divide."""
        size = fsdp_shard_size(cfg, world, device, section)
        tp, sp, pp = cfg.tensor_parallel_size, cfg.ulysses_sequence_parallel_size, cfg.pipeline_model_parallel_size
        check_divides(world, tp, sp, section, pp=pp)
        fsdp_ranks = world // (tp * pp)
        return cls(dp_replicate=fsdp_ranks // size, dp_shard=size, tp=tp, sp=sp, pp=pp)

    # --- sizes -----------------------------------------------------------------
    @property
    def world(self) -> int:
        """Ranks in the layout."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel groups: distinct shards of the batch."""
        return self.dp_replicate * self.dp_shard // self.sp

    @property
    def ranks_per_dp_group(self) -> int:
        """Ranks that hold the same rows of the batch (pp x sp x tp)."""
        return self.pp * self.sp * self.tp

    @property
    def fsdp_ranks(self) -> int:
        """Ranks FSDP2 spreads each (pp, tp) slot's parameters over (dp x sp)."""
        return self.dp_replicate * self.dp_shard

    # --- rank <-> coordinates ------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        """`rank`'s (pp, dp, sp, tp) coordinates."""
        self._check_rank(rank)
        rest, tp = divmod(rank, self.tp)
        rest, sp = divmod(rest, self.sp)
        pp, dp = divmod(rest, self.dp)
        return Coords(pp, dp, sp, tp)

    def rank_of(self, coords: Coords) -> int:
        """The global rank at `coords` (the inverse of `coords`)."""
        return ((coords.pp * self.dp + coords.dp) * self.sp + coords.sp) * self.tp + coords.tp

    def fsdp_coords(self, rank: int) -> tuple[int, int]:
        """`rank`'s (dp_replicate, dp_shard) index in FSDP's view of its tp slot."""
        self._check_rank(rank)
        return divmod(rank // self.tp % self.fsdp_ranks, self.dp_shard)

    def is_collect(self, rank: int) -> bool:
        """Whether `rank` returns its dp group's rows to the controller (the group's first sp and tp rank of
        the last pipeline stage, where the outputs are computed)."""
        c = self.coords(rank)
        return c.sp == 0 and c.tp == 0 and c.pp == self.pp - 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the layout's {self.world} ranks")

    # --- meshes ----------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with axes (pp, dp, sp, tp) (a collective: every rank calls it); submeshes by
        `mesh[Axis.SP.value]` and so on. pp is left out while it is 1 (the meshes stay as before pp existed)."""
        return self._mesh(device_type, ((Axis.DP, self.dp), (Axis.SP, self.sp), (Axis.TP, self.tp)))

    def build_param_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh the parameters live on, axes (pp, dp_replicate, dp_shard, tp): FSDP2 shards over dp_replicate x
        dp_shard (`fsdp_submesh`), tensor parallel splits over tp (the two must share one root mesh), each pp stage
        holds its own parameters. pp is left out while it is 1. A collective."""
        sizes = ((Axis.DP_REPLICATE, self.dp_replicate), (Axis.DP_SHARD, self.dp_shard), (Axis.TP, self.tp))
        return self._mesh(device_type, sizes)

    def _mesh(self, device_type: str, sizes: tuple[tuple[Axis, int], ...]) -> DeviceMesh:
        if self.pp > 1:
            sizes = ((Axis.PP, self.pp), *sizes)
        names = tuple(axis.value for axis, _ in sizes)
        return init_device_mesh(device_type, tuple(n for _, n in sizes), mesh_dim_names=names)

    def fsdp_submesh(self, param_mesh: DeviceMesh) -> DeviceMesh:
        """The submesh of `param_mesh` that `fully_shard` takes: 1-D (dp_shard) when nothing is replicated,
        else 2-D (dp_replicate, dp_shard) for HSDP."""
        if self.dp_replicate == 1:
            return param_mesh[Axis.DP_SHARD.value]
        return param_mesh[Axis.DP_REPLICATE.value, Axis.DP_SHARD.value]


def fsdp_shard_size(cfg: ParallelSizes, world: int, device: torch.device | str, section: str = "engine.") -> int:
    """`engine.fsdp_size` with None (1 on CPU, -1 on GPU) and -1 (all the dp x sp ranks of a (pp, tp) slot)
    resolved; it must divide world / (tensor_parallel_size x pipeline_model_parallel_size) (sequence parallel is not
    checked here: `check_divides`)."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_model_parallel_size
    check_divides(world, tp, 1, section, pp=pp)
    fsdp_ranks = world // (tp * pp)
    size = cfg.fsdp_size if cfg.fsdp_size is not None else (1 if torch.device(device).type == "cpu" else -1)
    size = fsdp_ranks if size == -1 else size
    if fsdp_ranks % size:
        split = " x ".join(k for k, n in (("tensor_parallel_size", tp), ("pipeline_model_parallel_size", pp)) if n > 1)
        what = f"dp groups ({fsdp_ranks} = ranks / {split})" if split else f"ranks ({fsdp_ranks})"
        raise ValueError(f"{section}fsdp_size={size} must divide the number of {what}")
    return size


def check_divides(world: int, tp: int, sp: int, section: str = "engine.", *, pp: int = 1) -> None:
    """Refuse tp x sp x pp that does not divide `world`, naming the keys of `section` that are > 1."""
    sizes = (("tensor_parallel_size", tp), ("ulysses_sequence_parallel_size", sp), ("pipeline_model_parallel_size", pp))
    for key, size in sizes:
        if size < 1:
            raise ValueError(f"{section}{key} must be >= 1, got {size}")
    if world % (tp * sp * pp):
        keys = [f"{section}{k}={v}" for k, v in sizes if v > 1]
        raise ValueError(f"{' x '.join(keys)} must divide the number of ranks ({world})")


@dataclass(frozen=True)
class GenerationDims:
    """The rollout's layout: tp groups of `tp` ranks `stride` apart over `world` ranks."""

    world: int
    """Ranks of the worker set."""
    tp: int
    """Ranks one generation engine spans (`rollout.tensor_model_parallel_size`)."""
    stride: int = 1
    """Distance between the ranks of a tp group (1: consecutive ranks; see `aligned_stride`)."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.stride < 1:
            raise ValueError(f"GenerationDims: tp and stride must be >= 1, got {self.tp}, {self.stride}")
        if self.world % (self.tp * self.stride):
            raise ValueError(
                f"rollout.tensor_model_parallel_size={self.tp} (groups {self.stride} ranks apart) must divide the "
                f"number of ranks ({self.world})"
            )

    @property
    def dp(self) -> int:
        """Generation engines (distinct shards of the prompts)."""
        return self.world // self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp index, tp index) of global `rank`."""
        return group_coords(rank, self.tp, self.stride)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """(dp, tp) with consecutive tp groups, else (outer, tp, inner) with dp = outer x inner. A collective."""
        if self.stride == 1:
            names = (Axis.DP.value, Axis.TP.value)
            return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=names)
        shape = (self.world // (self.tp * self.stride), self.tp, self.stride)
        names = (Axis.OUTER.value, Axis.TP.value, Axis.INNER.value)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def group_coords(rank: int, tp: int, stride: int) -> tuple[int, int]:
    """(dp index, tp index) of global `rank` when tp groups are `tp` ranks `stride` apart: the ranks laid
    out as (outer, tp, stride), stride fastest (stride 1: groups of consecutive ranks)."""
    return (rank // (tp * stride)) * stride + rank % stride, (rank // stride) % tp


def aligned_stride(fsdp_shard: int | None, tp: int) -> int:
    """The stride of generation tp groups that puts every rank's FSDP rows inside its generation shard.

    FSDP over a shard group of `fsdp_shard` consecutive ranks gives rank r row chunk r mod fsdp_shard;
    generation chunk i covers fsdp_shard / tp of those chunks, so the ranks that hold them should be
    tp index i: tp groups of ranks fsdp_shard / tp apart (dp6 -> tp3 x dp2: {0,2,4}, {1,3,5}; consecutive
    groups would leave 4 of 6 ranks holding rows outside their shard). 1 (consecutive) when the training
    layout is not plain FSDP (`fsdp_shard` None, e.g. tensor parallel training, whose tp shards consecutive
    groups match) or `tp` does not divide the shard group.
    """
    if fsdp_shard is None or fsdp_shard % tp:
        return 1
    return fsdp_shard // tp
