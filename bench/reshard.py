"""Weight sync into a tensor-parallel rollout: the 3D-HybridEngine reshard vs the plain full gather, side by side.

For each layout, `world` processes (1 thread each, gloo over loopback, oversubscribed on the cores)
hold SmolLM2-135M twice: the actor's training shards (fp32 FSDP2, or dp x tp with the tensor-parallel
engine, or pipeline stages: pp x dp, pp x tp) and the native rollout's generation shard (bf16, rollout.tensor_model_parallel_size=tp_g,
dp_g = world / tp_g groups). Round by round, alternating:

- `plain`:   gather the full model on every rank (`gather_full`, each tied weight once; with pipeline
             stages `Engine.full_state_dict`, which also exchanges the stages' full weights), then
             `load_weights` takes this rank's chunks (what sync_weights did before the reshard).
- `reshard`: `reshard_into` (hybridflow/engine/reshard.py): each rank receives only the pieces of
             its generation shard it does not hold, written straight into the rollout's tensors.

Per variant: transition time (the slowest rank's, median over `--rounds` after one warm-up round);
peak extra bytes per rank counted from the buffers each variant allocates (plain: the gathered
full weights; reshard: its send/receive buffers), the largest over ranks; and the RSS high-water
mark above the RSS before the call (malloc trimmed first), the largest over ranks; for the reshard
also the bytes a rank receives (the most over ranks). The first round checks that both variants
leave identical rollout weights.

SmolLM2 has 9 attention heads and 3 kv heads, so tensor parallel sizes are 1 or 3 only: the
layouts are 3 ranks FSDP dp3 -> tp3, 6 ranks dp2 x tp3 (tensor-parallel engine) -> tp3 x dp2,
and 6 ranks FSDP dp6 -> tp3 x dp2, with generation tp groups spaced as the worker spaces them
({0,2,4}, {1,3,5}: each FSDP shard inside its generation shard) and, for comparison, consecutive.
With pipeline stages (30 layers: 2 or 3 stages): 3 ranks pp3 -> tp3, 6 ranks pp2 x tp3 -> tp3 x dp2
and 6 ranks pp2 x dp3 (FSDP over each stage's 3 ranks) -> tp3 x dp2, generation groups consecutive
(as the worker lays them out beside a pipelined actor).

    PYTHONPATH=. .venv/bin/python bench/reshard.py --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = {
    "dp3": (3, 1, 1, 3, True),
    "dp2xtp3": (6, 1, 3, 3, True),
    "dp6": (6, 1, 1, 3, True),
    "dp6-consecutive": (6, 1, 1, 3, False),
    "pp3": (3, 3, 1, 3, False),
    "pp2xtp3": (6, 2, 3, 3, False),
    "pp2xdp3": (6, 2, 1, 3, False),
}
"""name -> (world, pipeline stages, training tp, generation tp, whether generation tp groups are spaced as the
worker spaces them beside a plain FSDP actor (`aligned_stride`) or, False, consecutive ranks)."""


def _trim_and_rss() -> float:
    """Hand freed heap pages back (glibc), reset the RSS high-water mark; returns the current RSS in bytes."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(float(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _build(pp: int, train_tp: int, gen_tp: int, aligned: bool):
    from hybridflow.engine import EngineConfig, FSDPEngine
    from hybridflow.engine.reshard import aligned_stride
    from hybridflow.models import default_model_dir, load_tokenizer
    from hybridflow.rollout import RolloutConfig, build_rollout

    path = default_model_dir()
    cfg = EngineConfig(
        param_dtype="bf16",
        tensor_parallel_size=train_tp,
        pipeline_model_parallel_size=pp,
        fsdp_size=-1,
        cpu_keep_freed_memory=False,
    )
    engine = FSDPEngine.from_pretrained(path, cfg)
    stride = aligned_stride(dist.get_world_size() if train_tp == pp == 1 else None, gen_tp) if aligned else 1
    rollout = build_rollout(
        RolloutConfig(dtype="bf16", tensor_model_parallel_size=gen_tp), path, load_tokenizer(path), tp_stride=stride
    )
    return engine, rollout


def _variants(engine, rollout) -> dict:
    from hybridflow.engine.gather import gather_named
    from hybridflow.engine.reshard import ReshardStats, named_weights
    from hybridflow.rollout.sync import reshard_into

    def plain() -> tuple[int, int]:
        if engine.pipeline_stages > 1:
            full = engine.full_state_dict(dtype=rollout.weight_dtype)
        else:
            full = gather_named(named_weights(engine.module), rollout.weight_dtype)
        rollout.load_weights(full)
        return sum({id(t): t.nbytes for t in full.values()}.values()), 0

    def reshard() -> tuple[int, int]:
        stats = ReshardStats()
        reshard_into(rollout, engine, rollout.generation_layout(), stats)
        return stats.peak_extra, stats.received

    return {"plain": plain, "reshard": reshard}


def _timed(fn) -> tuple[float, ...]:
    """(seconds of the slowest rank, extra bytes, RSS high-water above the start, bytes received) of one
    collective call, each the largest over ranks."""
    base = _trim_and_rss()
    dist.barrier()
    start = time.perf_counter()
    extra, received = fn()
    dist.barrier()
    row = torch.tensor(
        [time.perf_counter() - start, float(extra), _status("VmHWM") - base, float(received)], dtype=torch.float64
    )
    dist.all_reduce(row, op=dist.ReduceOp.MAX)
    return tuple(row.tolist())


def _snapshot(rollout) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in rollout.shard_tensors().items()}


def _worker(rank: int, world: int, port: int, layout: tuple, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _quiet()
    dist.init_process_group("gloo")
    engine, rollout = _build(*layout[1:])
    variants = _variants(engine, rollout)
    runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in variants}
    first: dict[str, torch.Tensor] = {}
    for r in range(rounds + 1):  # round 0 warms up and checks the two agree
        for name, fn in variants.items():
            runs[name].append(_timed(fn))
            if r == 0:
                after = _snapshot(rollout)
                if name == "reshard":
                    assert all(torch.equal(after[k], first[k]) for k in after), "reshard != plain"
                first = after
    shard = sum({id(t): t.nbytes for t in rollout.shard_tensors().values()}.values())
    if rank == 0:
        torch.save({"runs": runs, "shard": shard}, out)
    dist.destroy_process_group()


def _quiet() -> None:
    """No loading progress bars, no DTensor advice on the plain path's gathers of tp-sharded weights."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(world: int, pp: int, train_tp: int, gen_tp: int, aligned: bool) -> str:
    from hybridflow.engine.reshard import aligned_stride

    dp = world // (pp * train_tp)
    parts = [f"pp{pp}" if pp > 1 else "", f"dp{dp}" if dp > 1 or pp == train_tp == 1 else "", f"tp{train_tp}"]
    train = "x".join(p for p in parts if p and p != "tp1")
    gen = f"tp{gen_tp}" + (f"xdp{world // gen_tp}" if world > gen_tp else "")
    stride = aligned_stride(world if train_tp == pp == 1 else None, gen_tp) if aligned else 1
    groups = "consecutive" if stride == 1 else f"{stride} apart"
    return f"{train} -> {gen}, generation tp groups {groups}"


def _report(name: str, world: int, res: dict) -> str:
    med = {v: [statistics.median(x[i] for x in runs[1:]) for i in range(4)] for v, runs in res["runs"].items()}
    (pt, pe, prss, _), (rt, re_, rrss, received) = med["plain"], med["reshard"]
    mib, shard = 2**20, res["shard"]
    return "\n".join(
        [
            f"{name} ({world} ranks)",
            f"  time      plain {pt:6.3f} s    reshard {rt:6.3f} s    ratio {rt / pt:4.2f}x",
            f"  extra     plain {pe / mib:6.1f} MiB  reshard {re_ / mib:6.1f} MiB  ratio {re_ / pe:4.2f}x  "
            f"(generation shard {shard / mib:.1f} MiB; reshard extra / shard {re_ / shard:4.2f})",
            f"  RSS peak  plain {prss / mib:6.1f} MiB  reshard {rrss / mib:6.1f} MiB  ratio {rrss / max(prss, 1):4.2f}x",
            f"  a rank receives at most {received / mib:.1f} MiB by reshard (plain: the full model less its own shard)",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    from hybridflow.models import default_model_dir
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(1), flush=True)
    default_model_dir()  # convert once before the workers race for it
    print(
        f"SmolLM2-135M, training fp32 shards -> bf16 generation shards; 1 thread per rank on {os.cpu_count()} "
        f"cores; medians of {args.rounds} rounds after 1 warm-up, slowest / largest rank",
        flush=True,
    )
    out = Path(f"/tmp/bench_reshard_{os.getpid()}.pt")
    for name in args.layouts:
        world = LAYOUTS[name][0]
        mp.spawn(_worker, args=(world, _free_port(), LAYOUTS[name], args.rounds, str(out)), nprocs=world)
        print(_report(_layout(*LAYOUTS[name]), world, torch.load(out)), flush=True)
    out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
