"""Weight-sync parity of the reshard (FSDP dp2 -> a tp2 native rollout, two gloo ranks): each rank checks its
own generation shard against the fingerprint the pieces' senders computed for it, so a healthy reshard gives no
finding and a shard placed on the wrong rank, a skipped reshard, a corrupted and a miscast shard are found at
their step, by the rank that holds them, and reported on every rank."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.models import tiny_model_dir

TP_STEP = 100
FULL = f"wrong_shard@2,skip_sync@3,corrupt_tensor@4,wrong_dtype@5,wrong_shard@{TP_STEP + 1}"
PRELOAD = ["torch", "transformers", "hybridflow.models", "hybridflow.engine.fsdp", "hybridflow.rollout.native.rollout"]
Q0 = "model.layers.0.self_attn.q_proj.weight"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, spec: str, steps: int) -> None:
    import torch.distributed as dist
    from faults import arm

    from hybridflow.engine import EngineConfig, FSDPEngine
    from hybridflow.engine.reshard import named_weights
    from hybridflow.models import load_tokenizer
    from hybridflow.rollout import RolloutConfig, build_rollout, sync_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    arm(parity=spec)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    path = tiny_model_dir("llama")
    cfg = RolloutConfig(do_sample=False, n=1, response_length=4, dtype="fp32", tensor_model_parallel_size=2)
    rollout = build_rollout(cfg, path, load_tokenizer(path))
    engine = FSDPEngine.from_pretrained(tiny_model_dir("llama", seed=1), EngineConfig(param_dtype="fp32"))
    names = named_weights(engine.module)
    out: dict = {"total": len(names), "split": len(set(names) & set(rollout.split_dims))}
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(0.01)  # every weight changes before every sync
        out[step] = sync_weights(rollout, engine, step=step, check=True, backend="native").findings
    if steps > 2:  # a tensor-parallel training engine: column shards (o_proj, down_proj) are pieces too
        from hybridflow.engine import FSDPEngine

        tp_cfg = EngineConfig(param_dtype="fp32", tensor_parallel_size=2)
        tp_engine = FSDPEngine.from_pretrained(tiny_model_dir("llama", seed=1), tp_cfg)
        for step in (TP_STEP, TP_STEP + 1):
            out[step] = sync_weights(rollout, tp_engine, step=step, check=True, backend="native").findings
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def _lines(findings: list[str], step: int) -> list[str]:
    """The two ranks' lines of `step`, rank 0's first."""
    assert len(findings) == 2, findings
    for rank, line in enumerate(findings):
        assert f"weight sync mismatch (rollout=native, path=reshard, step={step}, rank={rank}): " in line, line
    return findings


@pytest.mark.parametrize("spec, steps", [("wrong_shard@2", 2), pytest.param(FULL, 6, marks=pytest.mark.slow)])
def test_reshard_faults_are_found_by_the_rank_holding_the_shard(tmp_path: Path, spec: str, steps: int) -> None:
    for seed in (0, 1):
        tiny_model_dir("llama", seed=seed)  # build the caches before the workers race for them
    mp.set_forkserver_preload(PRELOAD)
    args = (2, _free_port(), str(tmp_path), spec, steps)
    mp.start_processes(_worker, args=args, nprocs=2, join=True, start_method="forkserver")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank reports every rank's findings
    got, total, split = ranks[0], ranks[0]["total"], ranks[0]["split"]
    faults = {int(step): kind for kind, step in (point.split("@") for point in spec.split(","))}
    assert all(got[step] == [] for step in range(1, steps + 1) if step not in faults)
    assert 0 < split < total
    for line in _lines(got[2], 2):  # swapped shards: every split weight, no whole one
        assert f"{split} of {total} tensors differ, first: model.embed_tokens.weight, {Q0}," in line
        assert "usual cause: a generation shard placed on the wrong rank" in line
    if steps > 2:
        assert all(f"{total} of {total} tensors differ" in line for line in _lines(got[3], 3))
        assert all(f"1 of {total} tensors differ, first: {Q0};" in line for line in _lines(got[4], 4))
        assert all("tensors differ" in line for line in _lines(got[5], 5))
        assert got[TP_STEP] == []
        assert all(f"{split} of {total} tensors differ" in line for line in _lines(got[TP_STEP + 1], TP_STEP + 1))
