"""ParallelDims / GenerationDims: sizes, validation messages and rank <-> coordinates by hand; the meshes they
build over 4 gloo ranks hold the ranks those coordinates say."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.engine.config import EngineConfig
from hybridflow.engine.parallel.dims import (
    Axis,
    Coords,
    GenerationDims,
    ParallelDims,
    aligned_stride,
    check_divides,
    group_coords,
)
from tests.engine_helpers import free_port


def _dims(world: int, **engine) -> ParallelDims:
    return ParallelDims.from_config(EngineConfig(**engine), world, "cpu", "actor.engine.")


def test_sizes_from_config():
    assert _dims(4) == ParallelDims(dp_replicate=4, dp_shard=1)  # CPU default fsdp_size 1: replicated
    assert _dims(4, fsdp_size=-1) == ParallelDims(dp_replicate=1, dp_shard=4)
    assert ParallelDims.from_config(EngineConfig(), 4, "cuda") == ParallelDims(1, 4)
    d = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, sp=2)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.sp, d.pp) == (2, 2, 2, 2, 1)
    assert (d.world, d.dp, d.fsdp_ranks, d.ranks_per_dp_group) == (8, 2, 4, 4)


def test_coordinates_by_hand():
    d = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, sp=2)
    # rank = (dp * 2 + sp) * 2 + tp
    want = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [(c.dp, c.sp, c.tp) for c in map(d.coords, range(8))] == want
    assert all(d.rank_of(d.coords(r)) == r for r in range(8))
    assert d.rank_of(Coords(pp=0, dp=1, sp=0, tp=1)) == 5
    # FSDP's view of a tp slot: its 4 dp x sp ranks as 2 replicas x 2 shards
    assert [d.fsdp_coords(r) for r in range(8)] == [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    assert [r for r in range(8) if d.is_collect(r)] == [0, 4]
    tp_only = _dims(4, tensor_parallel_size=2)
    assert [(c.dp, c.tp) for c in map(tp_only.coords, range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    sp_only = _dims(4, ulysses_sequence_parallel_size=2)
    assert [(c.dp, c.sp) for c in map(sp_only.coords, range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="rank 4 is outside"):
        sp_only.coords(4)


def test_pipeline_coordinates_by_hand():
    d = _dims(8, pipeline_model_parallel_size=2, tensor_parallel_size=2, fsdp_size=-1)
    assert (d.pp, d.dp, d.tp, d.dp_shard, d.dp_replicate, d.ranks_per_dp_group) == (2, 2, 2, 2, 1, 4)
    # rank = (pp * 2 + dp) * 2 + tp: pp outermost, so each stage is a contiguous block of dp x tp ranks
    assert [(c.pp, c.dp, c.tp) for c in map(d.coords, range(8))] == [
        (p, dp, t) for p in range(2) for dp in range(2) for t in range(2)
    ]
    assert all(d.rank_of(d.coords(r)) == r for r in range(8))
    assert [d.fsdp_coords(r) for r in range(8)] == [(0, 0), (0, 0), (0, 1), (0, 1)] * 2  # FSDP within a stage
    assert [r for r in range(8) if d.is_collect(r)] == [4, 6]  # the last stage's first tp rank of each dp group


def test_generation_coordinates_by_hand():
    g = GenerationDims(world=6, tp=3, stride=2)
    assert [g.coords(r) for r in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [group_coords(r, 3, 1) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert g.dp == 2 and aligned_stride(6, 3) == 2 and aligned_stride(4, 3) == aligned_stride(None, 2) == 1


def test_invalid_layouts_name_the_keys():
    with pytest.raises(
        ValueError,
        match=r"actor.engine.tensor_parallel_size=2 x actor.engine.ulysses_sequence_parallel_size=2 must divide "
        r"the number of ranks \(6\)",
    ):
        check_divides(6, 2, 2, "actor.engine.")
    with pytest.raises(ValueError, match=r"actor.engine.fsdp_size=3 must divide the number of dp groups \(2 = ranks"):
        _dims(4, tensor_parallel_size=2, fsdp_size=3)
    with pytest.raises(ValueError, match=r"actor.engine.fsdp_size=3 must divide the number of ranks \(4\)"):
        _dims(4, fsdp_size=3)
    with pytest.raises(
        ValueError, match=r"actor.engine.pipeline_model_parallel_size=3 must divide the number of ranks"
    ):
        _dims(4, pipeline_model_parallel_size=3)
    with pytest.raises(
        ValueError, match=r"fsdp_size=3 must divide the number of dp groups \(2 = ranks / pipeline_model"
    ):
        _dims(4, pipeline_model_parallel_size=2, fsdp_size=3)
    with pytest.raises(ValueError, match=r"rollout.tensor_model_parallel_size=4 .* must divide the number of ranks"):
        GenerationDims(world=6, tp=4)


def _mesh_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = ParallelDims(dp_replicate=2, dp_shard=1, tp=2, sp=1)
    mesh = dims.build_mesh("cpu")
    params = dims.build_param_mesh("cpu")
    fsdp = dims.fsdp_submesh(params)
    sp_dims = ParallelDims(dp_replicate=1, dp_shard=4, sp=2)
    pp_params = ParallelDims(dp_replicate=1, dp_shard=2, pp=2).build_param_mesh("cpu")
    gen = GenerationDims(world, tp=2, stride=2).build_mesh("cpu")
    groups = {
        "tp": dist.get_process_group_ranks(mesh[Axis.TP.value].get_group()),
        "dp": dist.get_process_group_ranks(mesh[Axis.DP.value].get_group()),
        "fsdp": fsdp.mesh.flatten().tolist(),
        "param_tp": params[Axis.TP.value].mesh.tolist(),
        "sp": dist.get_process_group_ranks(sp_dims.build_mesh("cpu")[Axis.SP.value].get_group()),
        "gen_tp": dist.get_process_group_ranks(gen[Axis.TP.value].get_group()),
        "pp": dist.get_process_group_ranks(pp_params[Axis.PP.value].get_group()),
        "pp_fsdp": pp_params[Axis.DP_SHARD.value].mesh.tolist(),
    }
    torch.save(groups, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow  # 4 gloo processes, ~17 s; the coordinates are checked by hand in the default suite
def test_meshes_hold_the_ranks_the_coordinates_say(tmp_path):
    mp.spawn(_mesh_worker, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["tp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert got["dp"] == [rank % 2, rank % 2 + 2]
        assert got["fsdp"] == got["dp"]  # dp 2 x tp 2: FSDP spans the dp ranks of this tp slot, replicated
        assert got["param_tp"] == got["tp"]
        assert got["sp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert got["gen_tp"] == [rank % 2, rank % 2 + 2]  # groups 2 ranks apart
        assert got["pp"] == [rank % 2, rank % 2 + 2]  # pp outermost: the stages of a dp slot are 2 ranks apart
        assert got["pp_fsdp"] == [rank // 2 * 2, rank // 2 * 2 + 1]  # FSDP within one stage
