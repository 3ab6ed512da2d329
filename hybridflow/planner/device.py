"""A device profile: what the planner's cost model knows of a machine, and how each figure is measured.

`DeviceProfile` holds per-token seconds of the run's own operators (planner/operators.py: the engine's log-prob
pass and update, the native rollout's decode step) at thread counts and (batch, length) points, the optimizer
step's seconds, the weight-sync copy's cost per byte and gloo collectives' latency and bandwidth between two
processes. `measure_point` and the functions beside it time them; `hybridflow profile` (cli/profile.py, planner/measure.py)
and the layout search (planner/layouts.py) call them. The cost model (planner/cost.py) reads the result: how
much a worker speeds up with more threads, and what tensor / sequence parallel and FSDP collectives cost.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.planner.operators import EngineOperators
from hybridflow.utils.atomic import atomic_file


@dataclass
class DevicePoint:
    """Per-token seconds of the operators at one thread count and shape."""

    threads: int
    """torch threads of the (one) worker measured."""
    batch: int
    """Sequences per call."""
    length: int
    """Tokens per sequence (forward / update); decode steps run after a prompt of this length (or
    `decode_prompt`)."""
    forward_s_per_token: float
    """Forward pass without grad (log-probs, values)."""
    train_s_per_token: float
    """Forward and backward of one update micro-batch (with `optimizer_s` 0: the optimizer step too)."""
    decode_s_per_token: float
    """One KV-cached decode step / its rows (decode_batch)."""
    decode_batch: int = 0
    """Rows of the decode steps; 0: `batch`. Decode's cost per token falls with the rows per step (each step
    reads every weight once), so it is measured at the rows a worker of this many threads decodes in the
    layouts compared: with a fixed batch, a worker of 2 threads gets twice the rows of a 1-thread one."""
    optimizer_s: float = 0.0
    """Seconds of one optimizer step (gradient norm, AdamW, zero-grad) over the whole model: a cost per
    optimizer step, not per token, that every worker holding the model whole pays in full. 0: not measured
    apart (profiles before it count it in train_s_per_token)."""
    decode_prompt: int = 0
    """Tokens of prompt before the decode steps; 0: `length`."""


@dataclass
class DeviceProfile:
    """A machine's measured costs for one model (what `hybridflow profile` writes)."""

    model: str
    """The model measured."""
    dtype: str
    """Its parameter dtype during the measurement (float32 / bfloat16)."""
    points: list[DevicePoint] = field(default_factory=list)
    """One per (threads, batch, length)."""
    weight_sync_s_per_byte: float = 0.0
    """Seconds per parameter byte to copy the weights into another model copy in the same process."""
    allreduce_latency_s: float = 0.0
    """Seconds of one small (1 KiB) gloo all-reduce between 2 processes."""
    allreduce_s_per_byte: float = 0.0
    """Extra seconds per byte of a large (4 MiB) gloo all-reduce between 2 processes."""
    allgather_s_per_byte: float = 0.0
    """Extra seconds per byte of the output of a large gloo all_gather_into_tensor between 2 processes (FSDP's
    parameter gather; on gloo several times an all-reduce's cost per byte). 0: not measured."""
    reducescatter_s_per_byte: float = 0.0
    """Extra seconds per byte of the input of a large gloo reduce_scatter_tensor between 2 processes (FSDP's
    gradient reduction). 0: not measured."""

    def speedup(self, kind: str, threads: int) -> float:
        """How much faster `kind` (forward / train / decode) runs per token on `threads` threads than on 1
        (median over the shapes measured at both); 1.0 when not measured."""
        key = f"{kind}_s_per_token"
        ratios = [
            getattr(a, key) / getattr(b, key)
            for a in self.points
            if a.threads == 1
            for b in self.points
            if b.threads == threads and (b.batch, b.length) == (a.batch, a.length)
        ]
        return statistics.median(ratios) if ratios else 1.0

    def save(self, path: Path) -> None:
        """Write to `path` atomically (a cached profile is never read half-written)."""
        with atomic_file(path) as f:
            f.write(json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def load(path: Path) -> DeviceProfile:
        raw = json.loads(Path(path).read_text())
        return DeviceProfile(**{**raw, "points": [DevicePoint(**p) for p in raw["points"]]})


def _best_of(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None, warm: bool = True) -> float:
    """The fastest of `repeats` calls of `fn` after a warm-up call (`warm`: `fn` has not run yet); `sync` runs
    before each call (a barrier with the node's other workers, so that every call runs beside theirs)."""
    if warm:
        sync()
        fn()  # warm-up (allocator, oneDNN kernels, the rollout's cache)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_point(
    ops: EngineOperators,
    threads: int,
    batch: int,
    length: int,
    repeats: int = 2,
    decode_steps: int = 16,
    decode_batch: int = 0,
    sync: Callable[[], None] = lambda: None,
    warm: bool = True,
    decode_prompt: int = 0,
) -> DevicePoint:
    """Time the run's log-prob pass, update and decode step (planner/operators.py) at one thread count and
    shape. Update: the fastest call, less its optimizer step (timed inside the call, the fastest step kept
    apart). Decode per token: a generate call of decode_steps + 1 new tokens minus one of 1 new token (the
    prefill), over decode_steps x rows, after a prompt of `decode_prompt` tokens (0: `length`). `sync`, `warm`
    (each operator first warmed up): see `_best_of`."""
    torch.set_num_threads(threads)
    data = ops.batch(batch, length)
    tokens = batch * length
    fwd = _best_of(ops.log_probs(data), repeats, sync, warm) / tokens
    ops.optimizer_s.clear()
    update = _best_of(ops.update(data), repeats, sync, warm)
    optimizer = min(ops.optimizer_s)
    rows = decode_batch or batch
    prompt = decode_prompt or length
    long, short = ops.generate(rows, prompt, decode_steps + 1), ops.generate(rows, prompt, 1)
    long_s, short_s = _best_of(long, repeats, sync, warm), _best_of(short, repeats, sync, warm)
    # floor: the long call's even share per token, where noise beats the difference (tiny models, loaded machine)
    decode = max(long_s - short_s, long_s / (decode_steps + 1)) / (decode_steps * rows)
    train = max(update - optimizer, 0.0) / tokens  # the two minima may come from different calls
    return DevicePoint(threads, batch, length, fwd, train, decode, decode_batch, optimizer, decode_prompt)


def interleaved_points(
    ops: EngineOperators,
    threads: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    rounds: int,
    decode_rows_per_thread: int = 0,
) -> list[DevicePoint]:
    """Every (threads, shape) point measured once per round, the rounds one after another, each operator's
    best over the rounds kept. The thread speedups are ratios of points, so their points are measured
    side by side: a slow spell of the machine lands on every thread count of one round alike, where
    measuring all of one thread count before the other put it on one side of the ratio (2-thread speedups
    of two back-to-back sequential profiles differed by up to 25%). Each operator is warmed up in the first
    round only."""
    best: dict[tuple[int, int, int], DevicePoint] = {}
    for r in range(max(1, rounds)):
        for t in threads:
            for b, n in shapes:
                rows = decode_rows_per_thread * t
                p = measure_point(ops, t, b, n, repeats=1, decode_batch=rows, warm=r == 0)
                best[(t, b, n)] = fastest(best.get((t, b, n), p), p)
    return list(best.values())


COSTS = ("forward_s_per_token", "train_s_per_token", "decode_s_per_token", "optimizer_s")
"""The measured fields of a DevicePoint."""


def fastest(a: DevicePoint, b: DevicePoint) -> DevicePoint:
    """Two measurements of one point as one: each cost the smaller."""
    return replace(a, **{c: min(getattr(a, c), getattr(b, c)) for c in COSTS})


def measure_weight_sync(model: torch.nn.Module) -> float:
    """Seconds per byte to load `model`'s state dict into a copy of it (the colocated weight sync's work)."""

    target = copy.deepcopy(model)
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return _best_of(lambda: target.load_state_dict(state), 2) / nbytes


def time_collectives(rank: int, store_dir: str, out: str) -> None:
    """Rank `rank` of 2 processes timing gloo collectives (rendezvous in `store_dir`); rank 0 writes
    [latency, all-reduce, all-gather, reduce-scatter s per byte] to `out`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=2)
    small, large = torch.zeros(256), torch.zeros(1 << 20)

    def timed(t: torch.Tensor, n: int) -> float:
        dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / n

    latency, big = timed(small, 20), timed(large, 5)
    gathered = torch.zeros(2 * large.numel())
    gather = _timed_call(lambda: dist.all_gather_into_tensor(gathered, large), 5)
    scatter = _timed_call(lambda: dist.reduce_scatter_tensor(large, gathered), 5)
    if rank == 0:
        per_byte = [
            max(0.0, t - latency) / n / 4
            for t, n in ((big, large.numel()), (gather, gathered.numel()), (scatter, gathered.numel()))
        ]
        Path(out).write_text(json.dumps([latency, *per_byte]))
    dist.destroy_process_group()


def _timed_call(fn: Callable[[], None], n: int) -> float:
    """Mean seconds of `fn` (a collective) over `n` calls after one warm-up, ranks lined up by a barrier."""

    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def measure_allreduce() -> tuple[float, float, float, float]:
    """(latency s, all-reduce, all-gather and reduce-scatter s per byte) of gloo collectives between two
    local processes."""

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(time_collectives, args=(tmp, out), nprocs=2, join=True)
        return tuple(json.loads(Path(out).read_text()))


def slowest(per_worker: Sequence[Sequence[DevicePoint]]) -> list[DevicePoint]:
    """Each point (the same order in every worker's list) with every cost the largest any worker measured."""
    return [replace(same[0], **{c: max(getattr(p, c) for p in same) for c in COSTS}) for same in zip(*per_worker)]
