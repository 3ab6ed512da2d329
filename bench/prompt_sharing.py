"""Actor update and log-prob pass with the n samples of a prompt sharing one copy of it, side by side.

Each of 2 processes (1 thread each, gloo over loopback: the main job's layout; `--ranks 1`: one
process with 2 threads, bench/vs_trl.py's 1x2 and local layouts) holds one engine per variant on the real model and times them round by round in a shuffled order
shared by both ranks, on the main job's batch shape: per rank `--prompts` prompts x `--n`
samples, `--prompt` prompt tokens (the arithmetic task's chat prompt is ~45), response
lengths drawn in [`--min-response`, `--response`]. Variants (EngineConfig):

- `trimmed`: the default layout: padded rows, padding columns shared by all rows dropped.
- `packed`:  every row's real tokens back to back in one row (engine.packing).
- `shared`:  one packed row per micro-batch in which each prompt appears once and its
             samples' responses attend to it under a block mask (engine.share_prompts); attention
             computes only the pairs the mask allows (engine/prefix_attention.py).
- `dense`:   `shared` with the attention a dense masked product over the whole row (transformers'
             SDPA with the [N, N] mask: what `shared` ran before prefix_attention).

Per round and rank: one actor update = `--minis` train_steps (one micro-batch each, as
in the main job), then one compute_log_probs over all rows. A round's time is the slower
rank's; medians over `--rounds` after one warm-up round.

    .venv/bin/python bench/prompt_sharing.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig  # noqa: E402
from hybridflow.models import default_model_dir, load_causal_lm  # noqa: E402
from hybridflow.protocol import keys  # noqa: E402

VARIANTS = {
    "trimmed": {"share_prompts": False},
    "packed": {"packing": True},
    "shared": {"share_prompts": True},
    "dense": {"share_prompts": True},
}


def group_batch(args, seed: int) -> dict[str, torch.Tensor]:
    """prompts x n rows; the n rows of a prompt share its tokens, responses right-padded to --response."""
    g = torch.Generator().manual_seed(seed)
    rows, width = args.prompts * args.n, args.prompt + args.response
    ids = torch.randint(0, 49152, (rows, width), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        ids[i, : args.prompt] = ids[(i // args.n) * args.n, : args.prompt]
        r = int(torch.randint(args.min_response, args.response + 1, (1,), generator=g))
        mask[i, : args.prompt + r] = 1
    return {
        keys.INPUT_IDS: ids,
        keys.ATTENTION_MASK: mask,
        keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
        keys.RESPONSES: ids[:, args.prompt :],
    }


def _loss(out, micro):
    mask = micro[keys.ATTENTION_MASK][:, -micro[keys.RESPONSES].shape[1] :]
    return -(out["log_probs"] * mask).sum() / mask.sum(), {}


def _run(engine: FSDPEngine, data: dict, args) -> tuple[float, float]:
    rows = args.prompts * args.n
    mini = rows // args.minis
    dist.barrier()
    t0 = time.perf_counter()
    for m in range(args.minis):
        engine.train_step([{k: v[m * mini : (m + 1) * mini] for k, v in data.items()}], _loss)
    t1 = time.perf_counter()
    engine.compute_log_probs(data, mini)
    return t1 - t0, time.perf_counter() - t1


def _worker(rank: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(2 // args.ranks)
    dist.init_process_group("gloo")
    names = args.variants.split(",")
    engines = {
        n: FSDPEngine(load_causal_lm(default_model_dir()), EngineConfig(**VARIANTS[n]), OptimConfig(lr=1e-6))
        for n in names
    }
    if "dense" in engines:  # SDPA ignores the layout the engine passes and runs the [N, N] mask
        engines["dense"].module.set_attn_implementation("sdpa")
    data = group_batch(args, seed=rank)
    times: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in range(args.rounds + 1):
        order = list(names)
        random.Random(r).shuffle(order)  # same order on both ranks
        for name in order:
            both = [None] * args.ranks
            dist.all_gather_object(both, _run(engines[name], data, args))
            if r > 0:  # round 0 warms up allocations and oneDNN kernel choice
                times[name].append((max(t[0] for t in both), max(t[1] for t in both)))
    if rank == 0:
        _report(times, data, args)
    if args.profile:
        _profile(engines[names[0]], data, args, rank)
    dist.destroy_process_group()


def _profile(engine: FSDPEngine, data: dict, args, rank: int) -> None:
    """One more update of the first variant under torch.profiler; rank 0 prints the ops (and FSDP ranges, merged
    over layers) with the most CPU time, children included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(engine, data, args)
    if rank != 0:
        return
    merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for event in prof.key_averages():
        row = merged[event.key.split(" (")[0]]  # "FSDP::post_backward_reduce (model.layers.3)" -> one row
        row[0] += event.cpu_time_total / 1e6
        row[1] += event.self_cpu_time_total / 1e6
        row[2] += event.count
    print(f"profile of one '{args.variants.split(',')[0]}' round (update + log-prob pass), rank 0, seconds:")
    for name, (total, own, calls) in sorted(merged.items(), key=lambda kv: -kv[1][0])[: args.profile]:
        print(f"  {name[:64]:64s} total {total:7.3f}  self {own:7.3f}  calls {calls}")


def _report(times: dict, data: dict, args) -> None:
    real = int(data[keys.ATTENTION_MASK].sum())
    shared = real - (args.n - 1) * args.prompts * args.prompt
    print(
        f"{args.ranks} rank(s) x {2 // args.ranks} thread(s), gloo; per rank {args.prompts} prompts x {args.n} samples, {args.prompt} prompt + "
        f"{args.min_response}-{args.response} response tokens ({real} real tokens, {shared} with shared prompts), "
        f"{args.minis} mini-batches; median of {args.rounds} rounds (slower rank), seconds"
    )
    base = (
        {k: statistics.median(t[i] for t in times["trimmed"]) for i, k in enumerate(("upd", "lp"))}
        if "trimmed" in times
        else None
    )
    print(
        f"{'variant':8s} {'update':>8s} {'speedup':>8s} {'logprob':>8s} {'speedup':>8s}   all rounds (update/logprob)"
    )
    for name, t in times.items():
        upd, lp = statistics.median(x[0] for x in t), statistics.median(x[1] for x in t)
        su = f"{base['upd'] / upd:8.2f} {lp:8.2f} {base['lp'] / lp:8.2f}" if base else f"{'':8s} {lp:8.2f} {'':8s}"
        print(f"{name:8s} {upd:8.2f} {su}   " + " ".join(f"{a:.1f}/{b:.1f}" for a, b in t))


def main() -> None:
    """Parse flags and spawn the two ranks."""
    from hybridflow.utils.hardware import describe_cpu

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per rank")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt", type=int, default=45)
    ap.add_argument("--response", type=int, default=23, help="longest response (the padded width)")
    ap.add_argument("--min-response", type=int, default=5)
    ap.add_argument("--minis", type=int, default=2, help="mini-batches (optimizer steps) per update")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    ap.add_argument("--ranks", type=int, default=2, choices=(1, 2), help="1: one process with 2 threads")
    ap.add_argument("--profile", type=int, default=0, help="then profile the first variant: print this many rows")
    ap.add_argument("--variants", default="trimmed,shared", help=f"comma-separated, of {list(VARIANTS)}")
    args = ap.parse_args()
    print(describe_cpu(2 // args.ranks), f"(per rank; {args.ranks} rank(s) x {2 // args.ranks} thread(s))", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
