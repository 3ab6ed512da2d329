"""Dispatch overhead: a DP_COMPUTE_PROTO round trip vs the same work in raw Ray.

On 2 workers, for int64 batches of 256x8 and 256x1024, time
- hybridflow: `group.echo(batch)` — split (DataProto.chunk), one actor call per
  rank, wait, DataProto.concat; the worker method returns its shard;
- raw Ray, numpy: `ray.put` of each numpy shard, per-actor calls, `ray.get`,
  `np.concatenate` (the zero-copy fast path);
- raw Ray, torch: the same with contiguous torch shards.
The variants run interleaved, round by round in shuffled order, so load from
other processes hits them alike; medians are printed with the ratio to the faster raw variant.

    .venv/bin/python bench/dispatch.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from hybridflow import DataProto, Dispatch, Worker, register
from hybridflow.controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, init_local_ray
from hybridflow.utils.hardware import describe_cpu

WORKERS = 2
SIZES = [(256, 8), (256, 1024)]


class EchoWorker(Worker):
    """Returns its shard unchanged."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        """The shard this rank received."""
        return data


@ray.remote
class RawEcho:
    """The raw-Ray counterpart of EchoWorker."""

    def echo(self, x: Any) -> Any:
        return x


def raw_numpy(actors: list, x: np.ndarray) -> torch.Tensor:
    refs = [ray.put(s) for s in np.split(x, len(actors))]
    outs = ray.get([a.echo.remote(r) for a, r in zip(actors, refs)])
    return torch.from_numpy(np.concatenate(outs))


def raw_torch(actors: list, x: torch.Tensor) -> torch.Tensor:
    refs = [ray.put(s.contiguous()) for s in x.chunk(len(actors))]
    return torch.cat(ray.get([a.echo.remote(r) for a, r in zip(actors, refs)]))


def bench_size(group: RayWorkerGroup, actors: list, rows: int, cols: int, rounds: int) -> dict[str, float]:
    x = torch.randint(0, 50_000, (rows, cols), dtype=torch.int64)
    batch, x_np = DataProto.from_dict({"input_ids": x}), x.numpy()
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "hybridflow": lambda: group.echo(batch).batch["input_ids"],
        "raw_numpy": lambda: raw_numpy(actors, x_np),
        "raw_torch": lambda: raw_torch(actors, x),
    }
    for fn in variants.values():  # warm up, and check every variant returns the input
        for _ in range(5):
            assert torch.equal(fn(), x)
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants.items())
    for _ in range(rounds):
        random.shuffle(order)  # no variant always runs right after the heavy raw_torch one
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="timed calls per variant and size")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    init_local_ray(num_cpus=WORKERS)
    pool = RayResourcePool([WORKERS], num_cpus_per_process=0.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker), name_prefix="bench")
    actors = [RawEcho.options(num_cpus=0.5).remote() for _ in range(WORKERS)]
    print(f"{WORKERS} workers, {args.rounds} rounds, median ms per round trip")
    print(f"{'batch':>10} {'hybridflow':>11} {'raw_numpy':>10} {'raw_torch':>10} {'ratio':>6}")
    for rows, cols in SIZES:
        med = bench_size(group, actors, rows, cols, args.rounds)
        ratio = med["hybridflow"] / min(med["raw_numpy"], med["raw_torch"])
        print(
            f"{rows}x{cols:<6} {med['hybridflow'] * 1e3:11.2f} {med['raw_numpy'] * 1e3:10.2f} "
            f"{med['raw_torch'] * 1e3:10.2f} {ratio:6.2f}"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
