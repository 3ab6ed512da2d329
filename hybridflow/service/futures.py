"""Request futures: every state-changing call answers a request id at once; `retrieve_future` long-polls it.

A future ends as a JSON result, a protobuf result (forward_backward outputs and samples) or an error with a
category ("user" or "server"). A poll that finds it pending waits up to `POLL_WAIT_S` and then answers
`try_again`, so a client never waits on a dead request and never hammers a live one. Finished futures are
kept for `KEEP_S` after they end (a client may re-poll after a dropped connection), then dropped.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass

POLL_WAIT_S = 30.0
"""Longest a retrieve_future call waits for a pending result (the SDK's poll timeout is 45 s)."""
KEEP_S = 600.0
"""How long a finished future stays retrievable."""


@dataclass
class Outcome:
    """How a future ended: exactly one of json, proto, error."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"


class FutureStore:
    """Request id -> outcome (module docstring). Thread-safe: the worker thread ends futures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, tuple[Outcome, float]] = {}
        self._pending: set[str] = set()

    def new(self) -> str:
        """A fresh pending request id."""
        rid = f"req-{uuid.uuid4().hex}"
        with self._lock:
            self._pending.add(rid)
            self._prune()
        return rid

    def finish(self, rid: str, outcome: Outcome) -> None:
        """End `rid` with `outcome` (the first end wins)."""
        with self._lock:
            if rid in self._pending:
                self._pending.discard(rid)
                self._done[rid] = (outcome, time.monotonic())

    def fail(self, rid: str, message: str, category: str = "user") -> None:
        """End `rid` as failed."""
        self.finish(rid, Outcome(error=message, category=category))

    def known(self, rid: str) -> bool:
        with self._lock:
            return rid in self._pending or rid in self._done

    async def wait(self, rid: str, timeout: float = POLL_WAIT_S) -> Outcome | None:
        """`rid`'s outcome once it ends, or None when it is still pending after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            with self._lock:
                done = self._done.get(rid)
            if done is not None:
                return done[0]
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _prune(self) -> None:
        cutoff = time.monotonic() - KEEP_S
        for rid in [r for r, (_, t) in self._done.items() if t < cutoff]:
            del self._done[rid]
