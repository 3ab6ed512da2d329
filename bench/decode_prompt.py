"""Does the prompt before the timed decode steps change a device profile's decode cost per token?

Run: .venv/bin/python bench/decode_prompt.py [--rows 32] [--threads 1] [--prompts 16 64] [--rounds 4]

The planner's device profile (planner/device.py `measure_point`) times a native-rollout generate call of 17 new
tokens and one of 1 (the prefill) and takes decode per token as their difference over 16 x rows. The layout
search (planner/layouts.py) runs the calls after a `DECODE_PROMPT`-token prompt instead of the profile's
64-token sequences, so that the prefill it subtracts costs less. This bench times both calls after each prompt
length, the lengths alternating round by round on one SmolLM2 rollout in the default model's dtype for this CPU
(the dtype probe), and prints per round: the two calls' seconds and decode ms per token.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridflow.models import default_model_dir
from hybridflow.planner.operators import EngineOperators
from hybridflow.utils.dtypes import DTYPES
from hybridflow.utils.hardware import auto_compute_dtype, describe_cpu


def best_s(fn, repeats: int = 2) -> float:
    """The fastest of `repeats` calls (the first call of each, its warm-up, ran before)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="rows decoded per step (the main job's per worker)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print(describe_cpu(args.threads), flush=True)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[auto_compute_dtype("cpu", args.threads)]
    ops = EngineOperators(str(default_model_dir()), dtype)
    calls = {n: (ops.generate(args.rows, n, 17), ops.generate(args.rows, n, 1)) for n in args.prompts}
    for long, short in calls.values():
        long(), short()  # warm-up: the rollout's buffers
    print(f"SmolLM2 {dtype}, {args.rows} rows, {args.threads} thread(s); 17-token and 1-token generate calls")
    for r in range(args.rounds):
        for n, (long, short) in calls.items():
            long_s, short_s = best_s(long), best_s(short)
            decode_ms = (long_s - short_s) / (16 * args.rows) * 1e3
            print(f"round {r} prompt {n:>3}: {long_s:.2f} s / {short_s:.2f} s, decode {decode_ms:.3f} ms/token")


if __name__ == "__main__":
    main()
