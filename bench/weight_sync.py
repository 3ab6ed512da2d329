"""Weight-sync gather on 2 gloo ranks: tensor-by-tensor `full_tensor()` vs `gather_full`, side by side.

SmolLM2-135M sharded with FSDP2 over 2 CPU ranks (engine.fsdp_size=-1; 1 thread each), every unique
parameter gathered whole in bf16 (what `sync_weights` does before loading the
rollout copy). The two variants alternate round by round; medians and their ratio.

    .venv/bin/python bench/weight_sync.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from hybridflow.engine import EngineConfig, FSDPEngine
    from hybridflow.engine.gather import detached_full, gather_full
    from hybridflow.models import default_model_dir

    engine = FSDPEngine.from_pretrained(default_model_dir(), EngineConfig(fsdp_size=-1))  # sharded, as on GPU
    tensors = list({id(t): t for t in engine.model.state_dict().values()}.values())
    variants = {
        "per_tensor": lambda: [detached_full(t, torch.bfloat16) for t in tensors],
        "gather_full": lambda: gather_full(tensors, torch.bfloat16),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds + 1):  # the first round warms up
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        mb = sum(t.numel() for t in tensors) * 2 / 2**20
        med = {name: statistics.median(ts[1:]) for name, ts in times.items()}
        print(f"{len(tensors)} tensors, {mb:.0f} MiB in bf16, 2 gloo ranks x 1 thread, {rounds} rounds")
        for name, ts in times.items():
            print(f"{name:12s} median {med[name]:.3f} s   rounds {[round(t, 3) for t in ts[1:]]}")
        print(f"ratio per_tensor / gather_full: {med['per_tensor'] / med['gather_full']:.2f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(1), flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.rounds), nprocs=2, join=True)


if __name__ == "__main__":
    main()
