"""Resharding the actor's training shards to the rollout's generation layout (engine/reshard.py) on gloo
ranks gives exactly the generation shards (slices of the full weights) for tiny Llama and Qwen2 (biases)
at several layouts, reuses the held shard, receives less than the plain full gather (less still with
spaced tp groups beside FSDP), and a tp=2 native rollout fed by it (consecutive or spaced groups, or by
whole weights) generates greedily what one process generates."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.engine.reshard import (
    GenerationLayout,
    Piece,
    ReshardStats,
    aligned_stride,
    group_coords,
    named_weights,
    plan_pieces,
    reshard,
    split_pieces,
)
from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir
from hybridflow.rollout import build_rollout
from hybridflow.rollout.native.sharding import chunk_of, own_part, shard_module_, split_dims

ARCHS = ("llama", "qwen2")
PRELOAD = [
    "torch",
    "transformers",
    "hybridflow.models",
    "hybridflow.engine.parallel.tensor_parallel",
    "hybridflow.rollout.native.rollout",
]
KV4 = dict(num_heads=4, num_kv_heads=4)  # tp 4 needs 4 kv heads
CASES_4 = ((1, 2, -1, 1), (2, 2, -1, 1), (4, 2, -1, 1), (1, 4, -1, 1), (1, 2, 2, 1), (1, 2, -1, 2))
"""(training tp, generation tp, engine.fsdp_size, generation tp stride) on 4 ranks: dp4 -> tp2 x dp2,
tp2 x dp2 -> tp2 x dp2 (the training shard is a generation shard: only the dp pair exchanges), tp4 ->
tp2 x dp2, dp4 -> tp4, HSDP (2 replicas of dp2) -> tp2 x dp2, and dp4 -> tp2 x dp2 with tp groups
{0,2}, {1,3} (every FSDP shard inside its generation shard)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(fn, world: int, out_dir: Path) -> None:
    """`fn(rank, world, port, out_dir)` on `world` fresh processes forked from one server that imported the
    heavy modules once (spawn would import torch and transformers in every process: ~30 s for 4 on 2 cores)."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=(world, _free_port(), str(out_dir)), nprocs=world, join=True, start_method="forkserver")


def _start(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


def _engine(path: Path, tp: int, fsdp_size: int = -1):
    from hybridflow.engine import EngineConfig, FSDPEngine

    cfg = EngineConfig(param_dtype="fp32", tensor_parallel_size=tp, fsdp_size=fsdp_size)
    return FSDPEngine.from_pretrained(path, cfg)


def _check_shards(arch: str, train_tp: int, gen_tp: int, fsdp_size: int, stride: int, rank: int) -> ReshardStats:
    """Reshard an engine of `arch` to tp `gen_tp` and compare with chunks of the full weights."""
    path = tiny_model_dir(arch, **KV4)
    full = load_causal_lm(path).state_dict()
    layout = GenerationLayout(gen_tp, split_dims(load_causal_lm(path), gen_tp), stride)
    stats = ReshardStats()
    shards = reshard(
        named_weights(_engine(path, train_tp, fsdp_size).module),
        layout,
        torch.bfloat16,
        stats=stats,
        bucket_bytes=2**18,
    )  # several buckets even on a tiny model
    assert set(shards) == set(full)
    for name, want in full.items():
        if name in layout.split_dims:
            want = chunk_of(want, layout.split_dims[name], layout.tp_index(rank), gen_tp)
        assert torch.equal(shards[name], want.to(torch.bfloat16)), (arch, train_tp, gen_tp, stride, name)
    assert stats.allocated == sum({id(t): t.nbytes for t in shards.values()}.values())
    return stats


def _shards_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _start(rank, world, port)
    result = {}
    for arch in ARCHS:
        for case in CASES_4:
            result[(arch, *case)] = _check_shards(arch, *case, rank)
        result[arch, "greedy"] = _greedy_after_sync(arch, rank, stride=2)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _greedy_after_sync(arch: str, rank: int, stride: int) -> torch.Tensor:
    """A tp2 rollout of `arch` (seed 0; tp groups `stride` ranks apart), synced from an FSDP engine over every
    rank (seed 1): checks its shards and returns its greedy responses."""
    from hybridflow.rollout import build_rollout
    from hybridflow.rollout.sync import sync_weights

    rollout = build_rollout(_rollout_config(2), tiny_model_dir(arch), load_tokenizer(tiny_model_dir(arch)), stride)
    q = rollout.model.model.layers[0].self_attn.q_proj.weight
    assert q.shape[0] * 2 == rollout.model.config.num_attention_heads * 16  # holds only its shard
    sync_weights(rollout, _engine(tiny_model_dir(arch, seed=1), tp=1))  # reshards: FSDP -> tp2
    new = load_causal_lm(tiny_model_dir(arch, seed=1)).state_dict()
    index = rollout.generation_layout().tp_index(rank)
    for name, t in rollout.shard_tensors().items():
        dim = rollout.split_dims.get(name)
        assert torch.equal(t, new[name] if dim is None else chunk_of(new[name], dim, index, 2)), name
    return _greedy(rollout, arch)


def test_reshard_gives_generation_shards_on_4_ranks(tmp_path):
    for arch in ARCHS:
        for kw in (KV4, {}, dict(seed=1)):
            tiny_model_dir(arch, **kw)  # build the caches before the workers race for them
    _run(_shards_worker, 4, tmp_path)
    stats = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    model_bytes = sum(t.numel() * 2 for t in load_causal_lm(tiny_model_dir("llama", **KV4)).parameters())
    for arch in ARCHS:
        want = _greedy_one_process(arch)
        assert all(torch.equal(stats[r].pop((arch, "greedy")), want) for r in range(4)), arch
    for key in stats[0]:
        for r in range(4):
            s = stats[r][key]
            assert s.local > 0  # the held training shard is reused in place
            assert s.received < model_bytes * 3 / 4  # the plain gather receives 3/4 of the model
            assert s.peak_buffers <= s.allocated  # buffers beside the shard: at most its size
    assert stats[0]["llama", 2, 2, -1, 1].received < stats[0]["llama", 1, 2, -1, 1].received  # only dp pairs trade
    most = {stride: max(s["llama", 1, 2, -1, stride].received for s in stats) for stride in (1, 2)}
    assert most[2] < most[1]  # spaced groups: no rank holds rows outside its shard


def test_plan_takes_own_block_and_spreads_replicas():
    # a 4 x 2 weight: ranks 0, 1 hold rows 0-1 (replicas), ranks 2, 3 rows 2-3; generation: columns by tp 2
    held = (((0, 2), (0, 2)),) * 2 + (((2, 4), (0, 2)),) * 2
    targets = tuple(((0, 4), (r % 2, r % 2 + 1)) for r in range(4))
    pieces = plan_pieces(held, targets)
    assert Piece(0, 0, ((0, 2), (0, 1))) in pieces and Piece(2, 0, ((2, 4), (0, 1))) in pieces
    assert Piece(3, 1, ((2, 4), (1, 2))) in pieces  # receiver 1 takes replica 1 of the rows it lacks
    for dst in range(4):  # every target covered exactly once
        assert (
            sum((hi0 - lo0) * (hi1 - lo1) for p in pieces if p.dst == dst for (lo0, hi0), (lo1, hi1) in [p.region])
            == 4 * 1
        )
    cut = split_pieces((Piece(0, 1, ((0, 5), (0, 2))), Piece(1, 1, ((5, 9), (0, 2)))), max_elems=4)
    assert cut == (
        Piece(0, 1, ((0, 2), (0, 2))),
        Piece(0, 1, ((2, 4), (0, 2))),
        Piece(0, 1, ((4, 5), (0, 2))),
        Piece(1, 1, ((5, 9), (0, 2))),
    )  # moved pieces cut to 2 rows of 2; local ones kept whole


def test_spaced_generation_groups_match_fsdp_rows():
    assert aligned_stride(6, 3) == 2 and aligned_stride(None, 3) == aligned_stride(1, 3) == 1
    # dp6 -> tp3 x dp2, groups {0,2,4}, {1,3,5}: rank r holds FSDP chunk r of 6, inside generation chunk r // 2
    assert [group_coords(r, 3, 2) for r in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [group_coords(r, 3, 1) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_rollout_sharding_keeps_one_chunk_and_takes_whole_or_shards():
    model = load_causal_lm(tiny_model_dir("qwen2"))
    dims = split_dims(model, 2)
    assert dims["model.layers.0.self_attn.q_proj.bias"] == 0 and dims["model.layers.1.mlp.down_proj.weight"] == 1
    assert dims["model.embed_tokens.weight"] == dims["lm_head.weight"] == 0  # by vocabulary (49152 rows)
    assert "model.embed_tokens.weight" not in split_dims(model, 5)  # 5 does not divide the vocabulary
    assert "model.layers.0.self_attn.o_proj.bias" not in dims and "model.norm.weight" not in dims
    q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    full = shard_module_(model, dims, rank=1, tp=2)
    held = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(held, q[32:]) and held.untyped_storage().nbytes() == q.nbytes // 2
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, one chunk
    name = "model.layers.0.self_attn.q_proj.weight"
    assert own_part(q, 0, 1, 2, full[name]).data_ptr() == q[32:].data_ptr()
    assert own_part(held, 0, 1, 2, full[name]) is held
    with pytest.raises(ValueError, match="does not split"):
        GenerationLayout(3, dims).target(name, tuple(q.shape), 0)


def _generate_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _start(rank, world, port)
    res = {}
    for arch in ARCHS:
        res[arch, "reshard"] = _greedy_after_sync(arch, rank, stride=1)  # FSDP dp2 -> tp2
        rollout = build_rollout(_rollout_config(2), tiny_model_dir(arch), load_tokenizer(tiny_model_dir(arch)))
        rollout.load_weights(load_causal_lm(tiny_model_dir(arch, seed=1)).state_dict())  # whole tensors: chunked
        res[arch, "full"] = _greedy(rollout, arch)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def _rollout_config(tp: int):
    from hybridflow.rollout import RolloutConfig

    return RolloutConfig(do_sample=False, n=1, response_length=10, dtype="fp32", tensor_model_parallel_size=tp)


def _greedy(rollout, arch: str) -> torch.Tensor:
    from hybridflow.protocol.keys import RESPONSES
    from tests.rollout_helpers import prompt_batch

    return rollout.generate_sequences(prompt_batch(load_tokenizer(tiny_model_dir(arch)))).batch[RESPONSES]


def _greedy_one_process(arch: str) -> torch.Tensor:
    path = tiny_model_dir(arch, seed=1)
    return _greedy(build_rollout(_rollout_config(1), path, load_tokenizer(path)), arch)


def test_tp2_rollout_after_reshard_generates_as_one_process(tmp_path):
    for arch in ARCHS:
        for seed in (0, 1):
            tiny_model_dir(arch, seed=seed)
    _run(_generate_worker, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for arch in ARCHS:
        want = _greedy_one_process(arch)
        for got in ranks:
            assert torch.equal(got[arch, "reshard"], want) and torch.equal(got[arch, "full"], want), arch
