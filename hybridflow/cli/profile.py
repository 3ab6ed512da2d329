"""`hybridflow profile --model M [--out device_profile.json]`: per-token costs of the operators on this machine.

Measures at each thread count of --threads and each (batch, length) point, in this process or with --workers W
as one of W workers running at once, the weight sync and gloo's collectives (planner/measure.py
`profile_device`); writes the profile the cost model (planner/cost.py) reads.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridflow.models import default_model_dir
from hybridflow.planner.measure import profile_device


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `hybridflow profile`."""
    parser = argparse.ArgumentParser(
        prog="hybridflow profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF model directory (or 'default' for SmolLM2)")
    parser.add_argument("--out", default="device_profile.json")
    parser.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="comma-separated thread counts")
    parser.add_argument("--shapes", default="4x64,8x128", help="comma-separated BATCHxLENGTH points")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (each point: best over them)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="measure as one of this many workers running at once (the slowest's costs)",
    )
    parser.add_argument(
        "--decode-rows-per-thread",
        type=int,
        default=0,
        help="decode a batch of this x threads rows (default: each shape's BATCH); a run's rows "
        "per worker over its threads per worker",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """CLI of `hybridflow profile`; returns the exit code."""
    args = build_parser().parse_args(argv)
    threads = sorted({int(t) for t in args.threads.split(",")})
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    model = args.model
    if model == "default":
        model = str(default_model_dir())
    prof = profile_device(
        model,
        threads,
        shapes,
        getattr(torch, args.dtype),
        args.repeats,
        decode_rows_per_thread=args.decode_rows_per_thread,
        workers=args.workers,
    )
    prof.save(Path(args.out))
    for p in prof.points:
        print(
            f"threads {p.threads} {p.batch}x{p.length}: forward {p.forward_s_per_token * 1e3:.3f} ms/token, "
            f"train {p.train_s_per_token * 1e3:.3f} + optimizer step {p.optimizer_s:.3f} s, "
            f"decode {p.decode_s_per_token * 1e3:.3f}"
        )
    print(
        f"weight sync {prof.weight_sync_s_per_byte * 1e9:.3f} s/GB; all-reduce {prof.allreduce_latency_s * 1e6:.0f} us "
        f"+ {prof.allreduce_s_per_byte * 1e9:.2f} s/GB; wrote {args.out}"
    )
    return 0
