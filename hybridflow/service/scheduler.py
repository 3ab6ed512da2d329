"""One worker thread runs every model call, each training client's calls in `seq_id` order.

The SDK pipelines a training client's requests (forward_backward chunks may even arrive last-first), each
carrying `seq_id` = 1, 2, 3 ... per client. A call whose seq_id is the next one is queued at once (then any
held calls that follow it); a later one is held until the gap fills; one at or below a seq_id already taken
fails at once ("out of order"). A gap that stays open for `GAP_TIMEOUT_S` fails the calls held behind it,
naming the missing seq_id. Calls outside a sequence (sampling, model creation) run in arrival order.

Sampling calls are batched: a queued call with a batch key is run together with every other queued call of
the same key (same weights and sampling params), once no more arrive (`BATCH_QUIET_S`, at most
`BATCH_MAX_WAIT_S`), as one generate call of the native rollout. Batching only moves sampling calls earlier; training calls keep their
order.

A job's exception ends its future(s): `UserError` as category "user", anything else as "server" (logged with
its traceback); the worker itself keeps running, so one bad request never stops another client's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.service.errors import UserError
from hybridflow.service.futures import FutureStore, Outcome

log = logging.getLogger(__name__)

GAP_TIMEOUT_S = 120.0
"""How long held calls wait for a missing earlier seq_id before they fail."""
BATCH_QUIET_S = 0.03
"""A batch closes once no call of its key has arrived for this long (the SDK sends a burst of concurrent
samples over some tens of milliseconds; each split of one burst costs a whole extra generate call)..."""
BATCH_MAX_WAIT_S = 0.25
"""... or once it has waited this long in all."""
MAX_BATCH = 64
"""Most calls one batch holds."""

Job = Callable[[], Outcome]
BatchRun = Callable[[list[Any]], list[Outcome]]


@dataclass
class _Item:
    rid: str
    job: Job | None = None
    key: Hashable | None = None
    payload: Any = None
    run_batch: BatchRun | None = None


@dataclass
class _Lane:
    """One training client's sequence."""

    next_seq: int = 1
    held: dict[int, _Item] = field(default_factory=dict)
    gap_since: float | None = None


class Scheduler:
    """The worker thread and the per-client lanes (module docstring)."""

    def __init__(self, futures: FutureStore, gap_timeout_s: float = GAP_TIMEOUT_S) -> None:
        self.futures = futures
        self.gap_timeout_s = gap_timeout_s
        self.batch_sizes: list[int] = []
        """Calls per batched run, in run order (for benches and tests)."""
        self._lanes: dict[str, _Lane] = {}
        self._items: deque[_Item | None] = deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hybridflow-tinker-worker", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker thread, after the calls queued so far, and return what it returns (or raise
        what it raises): for work that must share the worker's thread, such as loading the models."""
        result: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> Outcome:
            try:
                result.set_result(fn())
            except BaseException as err:  # noqa: BLE001  (handed to the caller, which raises it)
                result.set_exception(err)
            return Outcome(json={})

        self._put(_Item("", job))
        return result.result()

    def submit(self, rid: str, job: Job) -> None:
        """Run `job` for request `rid` in arrival order."""
        self._put(_Item(rid, job))

    def submit_batchable(self, rid: str, key: Hashable, payload: Any, run_batch: BatchRun) -> None:
        """Run `payload` with the other queued payloads of `key`: `run_batch(payloads)` returns their outcomes."""
        self._put(_Item(rid, key=key, payload=payload, run_batch=run_batch))

    def submit_seq(self, lane: str, seq_id: int, rid: str, job: Job) -> None:
        """Run `job` as `lane`'s call number `seq_id` (module docstring)."""
        with self._cv:
            state = self._lanes.setdefault(lane, _Lane())
            if seq_id < state.next_seq or seq_id in state.held:
                waiting = f"and {seq_id} is waiting " if seq_id in state.held else ""
                self.futures.fail(
                    rid,
                    f"seq_id {seq_id} of model {lane} is out of order: seq_ids up to {state.next_seq - 1} are taken "
                    f"{waiting}(each call needs the next)",
                )
                return
            state.held[seq_id] = _Item(rid, job)
            while state.next_seq in state.held:
                self._items.append(state.held.pop(state.next_seq))
                state.next_seq += 1
            state.gap_since = time.monotonic() if state.held else None
            self._cv.notify()

    def drop_lane(self, lane: str) -> None:
        """Forget `lane` (its client was freed); held calls fail."""
        with self._cv:
            state = self._lanes.pop(lane, None)
        for item in state.held.values() if state else ():
            self.futures.fail(item.rid, f"model {lane} was freed before this call ran")

    def stop(self) -> None:
        """End the worker after the calls queued so far."""
        self._put(None)
        self._thread.join(timeout=30)

    def _put(self, item: _Item | None) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def _expire_gaps(self) -> None:
        now = time.monotonic()
        for lane, state in self._lanes.items():
            if state.gap_since is not None and now - state.gap_since > self.gap_timeout_s:
                for item in state.held.values():
                    self.futures.fail(
                        item.rid,
                        f"seq_id {state.next_seq} of model {lane} never arrived within {self.gap_timeout_s:.0f} s, "
                        "so the calls after it cannot run in order",
                    )
                state.next_seq = max(state.held) + 1
                state.held.clear()
                state.gap_since = None

    def _next(self) -> list[_Item] | None:
        """The next call, or batch of calls of one key (module docstring); None to stop."""
        with self._cv:
            while not self._items:
                if not self._cv.wait(timeout=1.0):
                    self._expire_gaps()
            first = self._items.popleft()
            if first is None or first.key is None:
                return None if first is None else [first]
            start = time.monotonic()
            quiet_until, batch = start + BATCH_QUIET_S, [first]
            while len(batch) < MAX_BATCH:
                taken = self._take_key(first.key, MAX_BATCH - len(batch))
                batch += taken
                now = time.monotonic()
                if taken:
                    quiet_until = now + BATCH_QUIET_S
                end = min(quiet_until, start + BATCH_MAX_WAIT_S)
                if now >= end:
                    break
                self._cv.wait(timeout=end - now)
            return batch

    def _take_key(self, key: Hashable, most: int) -> list[_Item]:
        taken = [item for item in self._items if item is not None and item.key == key][:most]
        for item in taken:
            self._items.remove(item)
        return taken

    def _run(self) -> None:
        while (batch := self._next()) is not None:
            if batch[0].run_batch is None:
                self._finish(batch, lambda: [batch[0].job()])
            else:
                self.batch_sizes.append(len(batch))
                self._finish(batch, lambda: batch[0].run_batch([item.payload for item in batch]))

    def _finish(self, batch: list[_Item], run: Callable[[], list[Outcome]]) -> None:
        try:
            outcomes = run()
        except UserError as err:
            outcomes = [Outcome(error=str(err), category="user")] * len(batch)
        except Exception as err:  # noqa: BLE001  (any failure ends these requests' futures, never the worker)
            log.exception("request %s failed", batch[0].rid)
            outcomes = [Outcome(error=f"{type(err).__name__}: {err}", category="server")] * len(batch)
        for item, outcome in zip(batch, outcomes, strict=True):
            self.futures.finish(item.rid, outcome)
