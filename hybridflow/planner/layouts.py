"""The layout search's device profiles: every candidate layout of the node measured by one set of processes.

trainer.n_workers_per_node=null compares splits of the node's cores (on 2 cores: 1 worker x 2 threads
against 2 x 1). A layout's profile is the costs of one of its workers while all of them run in lock step
(planner/device.py). Here one spawned set, as many processes as the largest layout has workers, measures
every layout, round after round, each layout once per round on its first `workers` processes while the
rest wait: the ranking compares layouts, so a slow spell of the machine lands on every layout of a round
alike; each process loads the model once, warms each operator up once, and times the collectives in the
same processes. On the slow-bf16 EPYC the search took 1m23s-1m29s this way, 2m02s-2m24s with a set of
processes per layout and two warm-ups per point.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.planner.device import (
    DevicePoint,
    DeviceProfile,
    fastest,
    measure_allreduce,
    measure_point,
    measure_weight_sync,
    slowest,
    time_collectives,
)
from hybridflow.planner.operators import EngineOperators

DECODE_PROMPT = 16
"""Prompt tokens before the timed decode steps. A decode step's cost is reading the weights more than the short
cache: SmolLM2 in bf16, 32 rows, 1 thread on the slow-bf16 EPYC decoded at 2.13-2.24 ms a token after 16 prompt
tokens and 2.31-2.36 after 64, and the two generate calls took 2.6 s against 6.4 (bench/decode_prompt.py)."""


@dataclass(frozen=True)
class Layout:
    """One split of the node's cores to profile."""

    workers: int
    """Worker processes running at once."""
    threads: int
    """torch threads of each."""
    decode_rows: int
    """Rows each worker decodes per step (the run's rows per worker)."""
    collectives: bool = False
    """Price gloo's collectives between workers (a run of more than one worker in all)."""


def profile_layouts(
    model_path: str,
    layouts: Sequence[Layout],
    shape: tuple[int, int],
    dtype: torch.dtype,
    rounds: int = 3,
    decode_prompt: int = DECODE_PROMPT,
) -> list[DeviceProfile]:
    """The profile of each of `layouts` (same order) at one (batch, length) `shape`: each cost the best over
    `rounds` of the slowest worker's, the decode steps after `decode_prompt` tokens (0: `shape`'s length); gloo's
    collectives, timed between two of the processes (or two more where the layouts have one worker each),
    priced in the profiles of the layouts that ask for them."""
    procs = max(layout.workers for layout in layouts)
    ctx = mp.get_context("spawn")
    barriers = {w: ctx.Barrier(w) for w in {layout.workers for layout in layouts}}
    everyone = ctx.Barrier(procs)
    wanted = any(layout.collectives for layout in layouts)
    args = (model_path, tuple(layouts), shape, dtype, rounds, decode_prompt, barriers, everyone, wanted and procs >= 2)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_layout_worker, (args, tmp), nprocs=procs, start_method="spawn")
        results = [json.loads(Path(tmp, f"{rank}.json").read_text()) for rank in range(procs)]
        if wanted:
            wire = json.loads(Path(tmp, "collectives.json").read_text()) if procs >= 2 else measure_allreduce()
    profiles = []
    for i, layout in enumerate(layouts):
        ranks = results[: layout.workers]
        points = slowest([[DevicePoint(**r["points"][str(i)])] for r in ranks])
        sync = max(r["weight_sync"] for r in ranks)
        costs = wire if layout.collectives else [0.0] * 4
        profiles.append(DeviceProfile(model_path, str(dtype).removeprefix("torch."), points, sync, *costs))
    return profiles


def _layout_worker(rank: int, args: tuple, out_dir: str) -> None:
    model_path, layouts, shape, dtype, rounds, decode_prompt, barriers, everyone, collectives = args
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # inherited from a parent that is a rank (local backend)
        os.environ.pop(name, None)  # each process measures as its own world of one
    ops = EngineOperators(model_path, dtype)  # opens a world-size-1 process group
    best: dict[int, DevicePoint] = {}
    for r in range(rounds):
        for i, layout in enumerate(layouts):
            if rank < layout.workers:
                timing = {"decode_batch": layout.decode_rows, "decode_prompt": decode_prompt, "warm": r == 0}
                p = measure_point(ops, layout.threads, *shape, 1, sync=barriers[layout.workers].wait, **timing)
                best[i] = fastest(best.get(i, p), p)
            everyone.wait()  # the idle processes wait: the next layout starts with every process free
    torch.set_num_threads(1)
    weight_sync = measure_weight_sync(ops.rollout_model)
    result: dict[str, Any] = {"weight_sync": weight_sync, "points": {str(i): asdict(p) for i, p in best.items()}}
    del ops
    dist.destroy_process_group()
    if collectives and rank < 2:
        time_collectives(rank, out_dir, os.path.join(out_dir, "collectives.json"))
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
