"""This machine's device profile: per-token costs of the run's operators at each thread count and (batch, length)
point, the weight sync, and gloo's collectives (`hybridflow profile`, cli/profile.py, is its command line).

Measures the run's own operators (planner/operators.py: the engine's log-prob pass and update, the native
rollout's decode step; planner/device.py) in this process, or with `workers` > 1 as one of that many workers
running at once (in spawned processes in lock step: planner/layouts.py). The cost model (planner/cost.py)
reads the result: how much a worker speeds up with more threads, and what tensor / sequence parallel and FSDP
collectives cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

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
