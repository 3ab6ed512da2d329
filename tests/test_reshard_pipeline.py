"""The 3D-HybridEngine reshard from pipeline-parallel training layouts (engine/reshard_plan.py `gathered_table`) on
gloo ranks: a tp2 native rollout synced from a pp2, pp2 x tp2 or pp2 x dp2 actor (tiny Llama and Qwen2 with tied
embeddings; each weight held only by its stage's ranks) holds, bit for bit, what the plain full gather
(`Engine.full_state_dict`) loads, while each rank receives less than its generation shard; the table is exchanged
once per engine; and the parity guard still finds a shard placed on the wrong rank and a skipped reshard, on
every rank, at their steps."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.engine.reshard_plan import merge_tables
from hybridflow.models import tiny_model_dir

PRELOAD = ["torch", "transformers", "hybridflow.models", "hybridflow.engine.fsdp", "hybridflow.rollout.native.rollout"]
FAULTS = "wrong_shard@2,skip_sync@3"
STEPS = 3
PP2 = dict(pipeline_model_parallel_size=2)
CASES_4 = {
    "pp2xtp2": dict(PP2, tensor_parallel_size=2),
    "pp2xdp2": dict(PP2, fsdp_size=-1),  # FSDP shards each stage over its 2 dp ranks
}
"""Training layouts on 4 ranks (generation: tp2 x dp2, groups {0, 1} and {2, 3})."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync_case(arch: str, layout: dict) -> dict:
    """Sync a tp2 rollout from a pipelined engine over steps 1..STEPS (every weight changed before each; faults by
    tests/faults, armed by `_worker`); after step 1 also load the plain full gather and compare the two."""
    from hybridflow.engine import EngineConfig, FSDPEngine
    from hybridflow.engine.reshard import ReshardStats
    from hybridflow.models import load_tokenizer
    from hybridflow.rollout import RolloutConfig, build_rollout, sync_weights
    from hybridflow.rollout.sync import reshard_into, weight_table

    path = tiny_model_dir(arch)
    cfg = RolloutConfig(do_sample=False, n=1, response_length=4, dtype="fp32", tensor_model_parallel_size=2)
    rollout = build_rollout(cfg, path, load_tokenizer(path))
    engine = FSDPEngine.from_pretrained(tiny_model_dir(arch, seed=1), EngineConfig(param_dtype="fp32", **layout))
    held = rollout.held_weights()
    res: dict = {"total": len(held)}
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            for p in engine.module.parameters():  # both stages' copies of the tied embedding alike
                p.add_(0.01)  # not 0.01 * step: doubling a constant tensor (0.03 -> 0.06) can keep its fingerprint
        res[step] = sync_weights(rollout, engine, step=step, check=True, backend="native").findings
        if step == 1:
            res["differ"] = _differs_from_full_gather(rollout, engine)
            # wrong_shard swaps the chunks of every split weight; those of a constant one (Qwen2's zero-initialised
            # q/k/v biases, shifted alike) are equal and cannot be told apart.
            res["split"] = sum(held[n].unique().numel() > 1 for n in rollout.split_dims if n in held)
            stats = ReshardStats()
            reshard_into(rollout, engine, rollout.generation_layout(), stats)
            res["stats"] = stats
            res["shard_bytes"] = sum({id(t): t.nbytes for t in held.values()}.values())
    res["cached"] = weight_table(engine) is weight_table(engine)
    return res


def _differs_from_full_gather(rollout, engine) -> list[str]:
    """The names whose tensors differ between the rollout's reshard and its load of `full_state_dict`."""
    resharded = {n: t.clone() for n, t in rollout.shard_tensors().items()}
    rollout.load_weights(engine.full_state_dict(dtype=rollout.weight_dtype))
    return [n for n, t in rollout.shard_tensors().items() if not torch.equal(t, resharded[n])]


def _worker(rank: int, world: int, port: int, out_dir: str, cases: dict) -> None:
    import torch.distributed as dist
    from faults import arm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    arm(parity=FAULTS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {(arch, name): _sync_case(arch, layout) for name, layout in cases.items() for arch in ("llama", "qwen2")}
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def _run(tmp_path: Path, world: int, cases: dict) -> list[dict]:
    for arch in ("llama", "qwen2"):
        for seed in (0, 1):
            tiny_model_dir(arch, seed=seed)  # build the caches before the workers race for them
    mp.set_forkserver_preload(PRELOAD)
    args = (world, _free_port(), str(tmp_path), cases)
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="forkserver")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check(ranks: list[dict]) -> None:
    for key in ranks[0]:
        got = [r[key] for r in ranks]
        total, split = got[0]["total"], got[0]["split"]
        for rank, res in enumerate(got):
            assert res["differ"] == [], (key, rank, res["differ"][:3])  # bit for bit the full gather's weights
            assert res[1] == [], (key, res[1])  # the guard's own fingerprints agree
            stats = res["stats"]
            assert 0 < stats.received < res["shard_bytes"] and stats.local > 0, (key, rank, stats)
            assert res["cached"]
            assert res[2] == got[0][2] and res[3] == got[0][3]  # every rank reports every rank's findings
        assert len(got[0][2]) == len(got[0][3]) == len(ranks), key  # each rank finds its own shard wrong
        for rank, (wrong, skipped) in enumerate(zip(got[0][2], got[0][3])):
            assert f"path=reshard, step=2, rank={rank}): {split} of {total} tensors differ" in wrong, (key, wrong)
            assert f"path=reshard, step=3, rank={rank}): {total} of {total} tensors differ" in skipped, key


def test_pp2_reshard_equals_full_gather_and_guard_finds_faults(tmp_path: Path) -> None:
    parts = [
        [(("model.embed_tokens.weight",), (8, 2), ((0, 8), (0, 2)))],
        [(("lm_head.weight",), (8, 2), ((0, 8), (0, 2)))],
    ]
    (tied,) = merge_tables(parts, {"lm_head.weight": "model.embed_tokens.weight"})
    assert tied.names == ("model.embed_tokens.weight", "lm_head.weight") and tied.held == (((0, 8), (0, 2)), None)
    _check(_run(tmp_path, 2, {"pp2": PP2}))


@pytest.mark.slow  # 4 gloo processes on 2 CPU cores
def test_pp2xtp2_and_pp2xdp2_reshard_equals_full_gather_and_guard_finds_faults(tmp_path: Path) -> None:
    _check(_run(tmp_path, 4, CASES_4))
