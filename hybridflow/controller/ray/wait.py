"""Waiting for the ranks of one call: never forever, and every failure names the group, rank(s) and method.

`RankCall` describes one issued call (group, method, ranks, their actors, when it started, its
timeout). Calling it with the call's object refs waits for them: a rank that raised re-raises its
error with a note naming the rank, a rank whose process died raises `WorkerError`, and ranks still
running at the deadline raise `WorkerTimeoutError` after being killed. It is picklable, so a
`DataProtoFuture` carries it to the workers that resolve the future, and the deadline holds there too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError

from hybridflow.controller.worker_group import WorkerError, WorkerTimeoutError

_DEATH = (RayActorError, WorkerCrashedError, ObjectLostError)


@dataclass(frozen=True)
class RankCall:
    """One call issued to some ranks of a worker group: what waiting for it needs to know."""

    group: str
    """The group's name, for messages."""
    method: str
    """The worker method called."""
    ranks: tuple[int, ...]
    """The ranks called; the i-th ref waited for comes from ranks[i]."""
    actors: tuple[Any, ...]
    """The Ray actor of each rank in `ranks`; those still running at the deadline are killed."""
    started: float
    """`time.time()` when the call was issued (wall clock: a future may be resolved in another process)."""
    timeout_s: float | None
    """Longest wait from `started`; None waits forever."""
    timeout_setting: str
    """The setting to raise, named in the timeout error."""
    poll_interval_s: float = 0.5
    """How often a wait wakes up to surface a failed rank before the others finish."""

    def __call__(self, refs: list) -> list:
        """The values behind `refs` (refs[i] from ranks[i]), in order; see the module docstring."""
        values: dict[Any, Any] = {}
        pending = list(refs)
        while pending:
            # fetch_local=False: the deadline is for the ranks to return, not for their outputs to arrive here
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self._next_wait_s(), fetch_local=False)
            if ready:
                values.update(zip(ready, self._get(ready, refs, pending)))
            if pending and self._next_wait_s() == 0:
                self._time_out(refs, pending)
        return [values[ref] for ref in refs]

    def _next_wait_s(self) -> float:
        """Seconds to the next wake-up: the poll interval, or less near the deadline (0 once past it)."""
        if self.timeout_s is None:
            return self.poll_interval_s
        return max(0.0, min(self.poll_interval_s, self.started + self.timeout_s - time.time()))

    def _rank_of(self, ref: Any, refs: list) -> int:
        return self.ranks[refs.index(ref)]

    def _get(self, ready: list, refs: list, pending: list) -> list:
        try:
            return ray.get(ready)  # one get for all: their transfers overlap
        except _DEATH + (RayTaskError,) as err:
            rank = self._failed_rank(ready, refs)
            running = f"; rank(s) {[self._rank_of(r, refs) for r in pending]} still running" if pending else ""
            if isinstance(err, RayTaskError):
                err.add_note(f"hybridflow: raised in group {self.group} rank {rank} method {self.method}{running}")
                raise
            raise WorkerError(
                f"worker of group {self.group} rank {rank} method {self.method} died: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}{running}",
                self.group,
                (rank,),
                self.method,
            ) from err

    def _failed_rank(self, ready: list, refs: list) -> int | None:
        """The rank of the first of `ready` whose value is an error."""
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:
                return self._rank_of(ref, refs)
        return None

    def _time_out(self, refs: list, pending: list) -> None:
        stuck = [self._rank_of(r, refs) for r in pending]
        done = [rank for rank in self.ranks if rank not in stuck]
        # A stuck actor would hold its CPUs/GPU and block every later call queued behind it;
        # killed, later calls fail at once naming it, and the caller rebuilds the group to recover.
        for ref in pending:
            ray.kill(self.actors[refs.index(ref)], no_restart=True)
        raise WorkerTimeoutError(
            f"group {self.group} method {self.method}: rank(s) {stuck} did not return within {self.timeout_s:g} s "
            f"({time.time() - self.started:.1f} s since the call; rank(s) {done} did). The stuck rank(s) were "
            f"killed. If the call is only slow, raise {self.timeout_setting}",
            self.group,
            tuple(stuck),
            self.method,
        )
