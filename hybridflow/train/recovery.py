"""Recovery from worker failures: restart the workers, reload the newest checkpoint, go on.

A worker failure is a worker process that died (killed, out of memory, segfault: Ray's
RayActorError and relatives, our `WorkerError`), a call that timed out (`WorkerTimeoutError`), or
a rank whose collective failed because a peer died or hung (gloo/NCCL errors raised in a worker).
Any other exception (a bug, bad data) is not retried: the same step would fail again. Nor is a `ParityError`
(hybridflow/parity/), even raised inside a worker: a restart would train on the same mismatch.

On a failure the restart loop (train/job.py `fit_with_restarts`, used by `hybridflow train` and `hybridflow sft`):
1. describes it while the workers are still there (group, rank, method, pid, node of the dead or stuck
   process, from Ray's actor table);
2. lets `started_workers` kill every worker and free the placement groups;
3. counts the restart against trainer.max_restarts within trainer.restart_window_s; once they are
   spent (or max_restarts=0), raises `RunFailedError`: one line naming the worker and the fix;
4. logs one line (what died, restart i of N, the checkpoint resumed, the steps redone), rewinds the
   metric loggers to the checkpoint's step (the redone steps replace, never duplicate, the old records:
   `Tracking.rewind`), starts the workers again (same placement; on a cluster, Ray places them on the
   nodes still alive) and continues from the newest complete checkpoint this run wrote, or the one it
   started from, or step 0. Loader position, RNG and KL coefficient come back from the checkpoint,
   so the metrics equal those of a run that never failed.
Every step's metrics carry `fault/restarts` and `fault/steps_redone` (totals so far in this process) and
`fault/recovery_s`: how long the last recovery took from the failure to training again (workers torn down
and restarted, models and checkpoint loaded), the cost of a restart apart from the steps it redoes.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hybridflow.controller.worker_group import WorkerError, WorkerTimeoutError
from hybridflow.parity import ParityError
from hybridflow.utils import checkpoint_dirs as C

log = logging.getLogger("hybridflow")

_COLLECTIVE_MARKS = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer")
"""Text of errors a rank gets from torch.distributed when a peer died or hung."""


_SOURCE_PREFIX = re.compile(r"^\[[^]]*\] ")
"""The "[/path/gloo/pair.cc:537] " gloo puts in front of its messages."""


class RunFailedError(RuntimeError):
    """A worker failure the run cannot recover from (restarts spent, or max_restarts=0); one-line message."""


@dataclass
class Failure:
    """One worker failure, described while the workers still exist."""

    what: str
    """E.g. "group X rank 1 (pid 5808, node 9028bc12) died in update_actor"."""
    step: int
    """The training step in progress (redone after the restart)."""
    error: BaseException
    """The exception the controller got."""


def is_worker_failure(err: BaseException, dead: list[str]) -> bool:
    """Whether `err` is a worker failure (see the module docstring); `dead`: the run's dead workers."""
    if isinstance(err, ParityError) or isinstance(getattr(err, "cause", None), ParityError):
        return False
    if isinstance(err, WorkerError):
        return True
    rx = sys.modules.get("ray.exceptions")
    if rx is None:  # Ray never imported (the local backend, perhaps without Ray installed): no Ray error to recognise
        return False
    if isinstance(err, rx.RayTaskError):
        cause = getattr(err, "cause", None)
        return (
            bool(dead)
            or isinstance(cause, (dist.DistError, WorkerError))
            or any(mark in str(cause or err) for mark in _COLLECTIVE_MARKS)
        )
    return isinstance(err, rx.RayError)  # RayActorError, OutOfMemoryError, NodeDiedError, ObjectLostError, ...


def _actor_info(actor: Any) -> dict[str, Any]:
    """Ray's record of an actor (State, Pid, Address.NodeID), or {} where Ray cannot say."""
    try:
        from ray._private import state  # noqa: PLC0415  (lazy: the local backend runs without Ray; the actor table; the public state API needs the dashboard)

        return state.actors(actor_id=actor._actor_id.hex()) or {}
    except Exception:  # a diagnostic only: never let it hide the failure being reported
        return {}


def _where(group: Any, rank: int, info: dict[str, Any]) -> str:
    node = (info.get("Address") or {}).get("NodeID", "?")[:8]
    return f"group {group.name} rank {rank} (pid {info.get('Pid', '?')}, node {node})"


def dead_workers(groups: list[Any]) -> list[str]:
    """`_where` of every worker of `groups` whose process Ray reports dead (Ray backend; [] otherwise)."""
    seen, dead = set(), []
    for group in groups:
        for rank, actor in enumerate(getattr(group, "workers", [])):
            info = _actor_info(actor)
            key = info.get("ActorID")
            if key in seen or info.get("State") != "DEAD":
                continue
            seen.add(key)
            dead.append(_where(group, rank, info))
    return dead


def describe(err: BaseException, groups: list[Any], dead: list[str]) -> str:
    """What failed, for the log and the final error: the group/rank/method/pid/node Ray knows."""
    if isinstance(err, WorkerError) and err.group is not None:
        group = next((g for g in groups if g.name == err.group), None)
        if group is not None and err.ranks:
            where = ", ".join(_where(group, r, _actor_info(group.workers[r])) for r in err.ranks)
            how = "timed out" if isinstance(err, WorkerTimeoutError) else "died"
            return f"{where} {how} in {err.method}"
    cause = getattr(err, "cause", None) or err  # a RayTaskError's cause is the worker's own exception
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    seen = f"{type(cause).__name__}: {_SOURCE_PREFIX.sub('', text)[:160]}"
    raised = re.search(r"raised in group (\S+) rank (\d+) method (\w+)", " ".join(getattr(err, "__notes__", [])))
    if not dead:
        return f"group {raised[1]} rank {raised[2]} method {raised[3]} raised {seen}" if raised else seen
    where = f" in {raised[3]} (rank {raised[2]} saw {seen})" if raised else f" ({seen})"
    return f"{'; '.join(dead)} died{where}"


@dataclass
class RestartBudget:
    """trainer.max_restarts within trainer.restart_window_s."""

    max_restarts: int
    """Restarts allowed within the window."""
    window_s: float
    """Width of the window, in seconds."""
    times: list[float] = field(default_factory=list)
    """time.monotonic() of every restart so far."""

    def take(self, now: float | None = None) -> int:
        """Count one restart; return its number within the window, or 0 when the budget is spent."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self.times if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            return 0
        self.times.append(now)
        return len(recent) + 1


class Recovery:
    """The state of one run's recoveries: its budget, the checkpoints it wrote, its counters."""

    def __init__(self, trainer_cfg: Any, start_from: Path | None) -> None:
        """`trainer_cfg`: the resolved trainer section; `start_from`: the checkpoint the run began from."""
        self.budget = RestartBudget(trainer_cfg.max_restarts, trainer_cfg.restart_window_s)
        self.start_from = start_from
        self.resume_from = start_from
        """The checkpoint the next attempt continues from."""
        self.saved: list[Path] = []
        """Checkpoints this run wrote, oldest first (the trainer's checkpointer appends)."""
        self.restarts = 0
        self.steps_redone = 0
        self.recovery_s = 0.0
        """Seconds the last recovery took, failure to training again (0 before any)."""
        self._failed_at: float | None = None

    def metrics(self) -> dict[str, float]:
        """The totals logged with every step."""
        return {
            "fault/restarts": float(self.restarts),
            "fault/steps_redone": float(self.steps_redone),
            "fault/recovery_s": self.recovery_s,
        }

    def failure(self, err: BaseException, groups: list[Any], step: int) -> Failure | None:
        """A `Failure` when `err` is a worker failure (call it before the workers are torn down), else None."""
        dead = dead_workers(groups)
        if not is_worker_failure(err, dead):
            return None
        self._failed_at = time.monotonic()
        return Failure(describe(err, groups, dead), step, err)

    def resumed(self) -> None:
        """Called by the trainer once it has restored its checkpoint: ends the recovery in progress, if any."""
        if self._failed_at is None:
            return
        self.recovery_s = time.monotonic() - self._failed_at
        self._failed_at = None
        log.warning(
            "recovered in %.1f s (workers restarted, models and checkpoint loaded); training again", self.recovery_s
        )

    def restart(self, failure: Failure, rewind: Callable[[int], None]) -> None:
        """Take one restart from the budget, pick the checkpoint, rewind the loggers and log the recovery
        line; raises `RunFailedError` when the budget is spent."""
        ckpt = self._newest_checkpoint()
        ckpt_step = C.checkpoint_step(ckpt) if ckpt is not None else 0
        number = self.budget.take()
        if number == 0:
            raise RunFailedError(self._give_up(failure, ckpt))
        self.restarts += 1
        self.steps_redone += max(0, failure.step - ckpt_step)
        self.resume_from = ckpt
        rewind(ckpt_step)
        log.warning(
            "worker failure: %s; restart %d of %d (trainer.max_restarts within %g s), resuming from %s, "
            "redoing steps %d-%d",
            failure.what,
            number,
            self.budget.max_restarts,
            self.budget.window_s,
            ckpt or "step 0 (no checkpoint yet)",
            ckpt_step + 1,
            max(failure.step, ckpt_step + 1),
        )

    def _newest_checkpoint(self) -> Path | None:
        """The newest undamaged checkpoint this run wrote, else the one it started from (or None)."""
        for path in reversed(self.saved):
            if not C.is_complete(path):
                continue  # pruned by max_ckpt_to_keep, or replaced and half-written when the failure hit
            problem = C.damage(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is damaged (%s); trying the previous one", path, problem)
        return self.start_from

    def _give_up(self, failure: Failure, ckpt: Path | None) -> str:
        b = self.budget
        spent = (
            f"trainer.max_restarts={b.max_restarts}"
            if b.max_restarts == 0
            else f"all {b.max_restarts} restarts (trainer.max_restarts) within {b.window_s:g} s are spent"
        )
        resume = f"resumes from {ckpt}" if ckpt else "starts again from step 0 (no checkpoint was written)"
        return (
            f"worker failure at step {failure.step}: {failure.what}; {spent}. Running the same command again "
            f"{resume} (trainer.resume_mode=auto); raise trainer.max_restarts to recover within the run"
        )
