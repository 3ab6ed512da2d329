"""`hybridflow profile --model M [--out device_profile.json]`: per-token costs of the operators on this machine.

Measures the run's own operators (planner/operators.py: the engine's log-prob pass and update, the native
rollout's decode step; planner/device.py) at each thread count of --threads and each (batch, length) point,
in this process, or with --workers W as one of W workers running at once (in W spawned processes in lock step:
planner/layouts.py); the cost of copying the weights into a second copy (weight sync), and gloo collectives'
latency and bandwidth between two processes. The cost model (planner/cost.py) reads the result: how much a
worker speeds up with more threads, and what tensor / sequence parallel and FSDP collectives cost.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.models import default_model_dir
from hybridflow.planner.device import (
    DevicePoint,
    DeviceProfile,
    interleaved_points,
    measure_allreduce,
    measure_weight_sync,
)
from hybridflow.planner.layouts import Layout, profile_layouts
from hybridflow.planner.operators import EngineOperators


def profile_device(
    model_path: str,
    threads: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
    repeats: int = 2,
    collectives: bool = True,
    decode_rows_per_thread: int = 0,
    workers: int = 1,
) -> DeviceProfile:
    """Measure every (threads, shape) point (`repeats` interleaved rounds), the weight sync and (collectives)
    gloo's collectives for `model_path`; with `workers` > 1, as one of that many workers running at once
    (planner/layouts.py, one set of processes per shape, the decode steps after each shape's length)."""
    if workers > 1:
        return _profile_concurrent(
            model_path, threads, shapes, dtype, repeats, collectives, decode_rows_per_thread, workers
        )
    points, weight_sync = _points_here(model_path, threads, shapes, dtype, repeats, decode_rows_per_thread)
    wire = measure_allreduce() if collectives else (0.0, 0.0, 0.0, 0.0)
    return DeviceProfile(model_path, str(dtype).removeprefix("torch."), points, weight_sync, *wire)


def _profile_concurrent(
    model_path: str,
    threads: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    rounds: int,
    collectives: bool,
    decode_rows_per_thread: int,
    workers: int,
) -> DeviceProfile:
    """`profile_device` for `workers` > 1: each thread count a layout of `workers` workers."""
    layouts = [Layout(workers, t, decode_rows_per_thread * t, collectives) for t in threads]
    per_shape = [profile_layouts(model_path, layouts, shape, dtype, rounds, decode_prompt=0) for shape in shapes]
    profiles = [prof for profs in per_shape for prof in profs]
    points: list[DevicePoint] = [p for prof in profiles for p in prof.points]
    weight_sync = max(prof.weight_sync_s_per_byte for prof in profiles)
    return replace(profiles[0], points=points, weight_sync_s_per_byte=weight_sync)


def _points_here(
    model_path: str,
    threads: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    rounds: int,
    decode_rows_per_thread: int,
) -> tuple[list[DevicePoint], float]:
    """The points and the weight sync's seconds per byte, measured in this process."""
    had_group = dist.is_initialized()
    ops = EngineOperators(model_path, dtype)  # opens a world-size-1 process group when none is open
    saved_threads = torch.get_num_threads()
    try:
        points = interleaved_points(ops, threads, shapes, rounds, decode_rows_per_thread)
        return points, measure_weight_sync(ops.rollout_model)
    finally:
        torch.set_num_threads(saved_threads)
        del ops
        if not had_group and dist.is_initialized():  # the caller's process may start workers next
            dist.destroy_process_group()


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
