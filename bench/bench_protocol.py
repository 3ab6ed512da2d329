"""Ray round trip (ray.put then ray.get) of a DataProto vs a plain dict of tensors.

Run: .venv/bin/python bench/bench_protocol.py [rows] [cols]
DataProto pickles each tensor as a numpy array (out-of-band, zero-copy into the object
store); a dict of tensors goes through torch's own pickling. Best of several repeats.
"""

import sys
import time

import ray
import torch

from hybridflow.protocol import DataProto


def best_round_trip(obj: object, repeats: int) -> float:
    """Best wall time in seconds of ray.get(ray.put(obj)) over `repeats` tries."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        ray.get(ray.put(obj))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Print round-trip times and throughputs for a few tensor sizes."""
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False)
    shapes = [(256, 1024), (8192, 1024)] if len(sys.argv) < 3 else [(int(sys.argv[1]), int(sys.argv[2]))]
    for rows, cols in shapes:
        tensors = {"input_ids": torch.randint(0, 50_000, (rows, cols))}
        mib = rows * cols * 8 / 2**20
        repeats = 20 if mib < 16 else 5
        for name, obj in [("DataProto", DataProto.from_dict(tensors)), ("dict of tensors", tensors)]:
            seconds = best_round_trip(obj, repeats)
            print(
                f"{rows}x{cols} int64 ({mib:.0f} MiB) {name:>16}: {seconds * 1e3:7.2f} ms "
                f"({mib / 1024 / seconds:.2f} GiB/s)"
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
