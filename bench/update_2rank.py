"""Actor update and log-prob pass of FSDPEngine on 2 gloo ranks, before/after, next to a 1-rank reference.

Each of 2 processes (1 thread each, gloo over loopback) holds three engines on the
real model and times, round by round in a shuffled order shared by both ranks:

- `before`: the engine as it was: reshard after forward (gather in forward AND in
  backward), gradient reduce-scatter after every micro-batch, a re-gather per
  micro-batch in the no-grad pass.
- `after`:  the current defaults (no reshard after forward on CPU, one gradient
  sync per optimizer step, one gather per inference call).
- `1-rank`: the same per-rank work on an FSDP mesh of the rank alone (no
  communication; both processes still run it at the same time, so CPU
  contention matches the 2-rank variants).

Per round and rank: one actor update = `--minis` train_steps over mini-batches of
`--rows / --minis` rows in micro-batches of `--micro` rows, then one
`compute_log_probs` over all `--rows` rows in micro-batches of `--micro`. A
round's time is the slower rank's. Medians over `--rounds` after one warm-up round.

    .venv/bin/python bench/update_2rank.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.models import default_model_dir, load_causal_lm
from hybridflow.protocol import keys
from hybridflow.utils.hardware import describe_cpu

VARIANTS = ("before", "after", "1-rank")


class BeforeEngine(FSDPEngine):
    """The pre-change behaviour: sync every micro-batch, re-gather per inference micro-batch."""

    def _set_grad_sync(self, sync: bool) -> None:
        self.model.set_requires_gradient_sync(True)

    @torch.no_grad()
    def _infer(self, data, micro_batch_size, **kw):
        from hybridflow.engine import batch as B

        self.model.eval()
        parts = defaultdict(list)
        for micro in B.split_micro_batches(B.select_inputs(data, self.device), micro_batch_size):
            for k, v in self.forward_micro_batch(micro, **kw).items():
                parts[k].append(v)
        return {k: torch.cat(v) for k, v in parts.items()}


class OneRankEngine(FSDPEngine):
    """Sharded over a mesh holding only this rank: the compute without any communication."""

    def __init__(self, model, config, optim, mesh: DeviceMesh) -> None:
        self._own_mesh = mesh
        super().__init__(model, config, optim)

    def _mesh(self) -> DeviceMesh:
        return self._own_mesh


def make_batch(rows: int, prompt: int, response: int, seed: int) -> dict[str, torch.Tensor]:
    """Unpadded random prompt+response rows (the shape of the main job's batches)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    return {
        keys.INPUT_IDS: ids,
        keys.ATTENTION_MASK: mask,
        keys.POSITION_IDS: mask.cumsum(-1) - 1,
        keys.RESPONSES: ids[:, prompt:],
    }


def _loss(out, micro):
    return -out["log_probs"].mean(), {}


def _build(rank: int, args) -> dict[str, FSDPEngine]:
    own = [dist.new_group([r]) for r in range(2)][rank]  # every rank must create every group
    optim = OptimConfig(lr=1e-6)
    path = default_model_dir()
    return {
        "before": BeforeEngine(load_causal_lm(path), EngineConfig(reshard_after_forward=True), optim),
        "after": FSDPEngine(load_causal_lm(path), EngineConfig(), optim),
        "1-rank": OneRankEngine(load_causal_lm(path), EngineConfig(), optim, DeviceMesh.from_group(own, "cpu")),
    }


def _run(engine: FSDPEngine, data: dict, args) -> tuple[float, float]:
    mini = args.rows // args.minis
    dist.barrier()
    t0 = time.perf_counter()
    for m in range(args.minis):
        rows = {k: v[m * mini : (m + 1) * mini] for k, v in data.items()}
        micros = [{k: v[i : i + args.micro] for k, v in rows.items()} for i in range(0, mini, args.micro)]
        engine.train_step(micros, _loss)
    t1 = time.perf_counter()
    engine.compute_log_probs(data, args.micro)
    return t1 - t0, time.perf_counter() - t1


def _profile(engine: FSDPEngine, data: dict, args, name: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(engine, data, args)
    if dist.get_rank() == 0:
        print(f"--- profile rank 0, {name} (update + log-prob pass), top by total CPU time ---")
        print(
            prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.profile_rows, max_name_column_width=48)
        )


def _worker(rank: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engines = _build(rank, args)
    data = make_batch(args.rows, args.prompt, args.response, seed=rank)
    times: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in range(args.rounds + 1):
        order = list(VARIANTS)
        random.Random(r).shuffle(order)  # same order on both ranks
        for name in order:
            own = _run(engines[name], data, args)
            both = [None, None]
            dist.all_gather_object(both, own)
            if r > 0:  # round 0 warms up allocations and oneDNN kernel choice
                times[name].append((max(t[0] for t in both), max(t[1] for t in both)))
    if args.profile:
        for name in ("before", "after"):
            _profile(engines[name], data, args, name)
    if rank == 0:
        _report(times, args)
    dist.destroy_process_group()


def _report(times: dict, args) -> None:
    print(
        f"2 ranks x 1 thread, gloo; per rank {args.rows} rows x ({args.prompt} prompt + {args.response} "
        f"response) tokens, {args.minis} mini-batches, micro-batch {args.micro}; "
        f"median of {args.rounds} rounds (slower rank), seconds"
    )
    ref = {k: statistics.median(t[i] for t in times["1-rank"]) for i, k in enumerate(("upd", "lp"))}
    print(
        f"{'variant':8s} {'update':>8s} {'x1-rank':>8s} {'logprob':>8s} {'x1-rank':>8s}   all rounds (update/logprob)"
    )
    for name in VARIANTS:
        upd = statistics.median(t[0] for t in times[name])
        lp = statistics.median(t[1] for t in times[name])
        rounds = " ".join(f"{a:.1f}/{b:.1f}" for a, b in times[name])
        print(f"{name:8s} {upd:8.2f} {upd / ref['upd']:8.2f} {lp:8.2f} {lp / ref['lp']:8.2f}   {rounds}")


def main() -> None:
    """Parse flags and spawn the two ranks."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32, help="rows per rank in one update")
    ap.add_argument("--minis", type=int, default=2, help="mini-batches (optimizer steps) per update")
    ap.add_argument("--micro", type=int, default=16, help="micro-batch rows (train and log-prob pass)")
    ap.add_argument("--prompt", type=int, default=45)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    ap.add_argument("--profile", action="store_true", help="also profile one before/after round on rank 0")
    ap.add_argument("--profile-rows", type=int, default=25)
    args = ap.parse_args()
    print(describe_cpu(1), "(per rank; 2 ranks x 1 thread)", flush=True)
    if args.rows % args.minis:
        ap.error(f"--rows ({args.rows}) must be a multiple of --minis ({args.minis})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
