"""Client sessions: what each ServiceClient created, and when it was last heard from.

The SDK sends a heartbeat every 10 s and finishes its session when it closes. A finished session, or one not
heard from for `timeout_s`, has its training clients' adapters and optimizer states and its in-memory sampler
snapshots freed (`reap`); checkpoints saved to disk stay.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

SESSION_TIMEOUT_S = 300.0
"""A session not heard from for this long is freed."""


@dataclass
class Session:
    """One client session's belongings."""

    session_id: str
    last_seen: float = field(default_factory=time.monotonic)
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    finished: bool = False


class SessionTable:
    """Every live session (module docstring). Thread-safe."""

    def __init__(self, timeout_s: float = SESSION_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def create(self) -> str:
        sid = f"session-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self._sessions[sid] = Session(sid)
        return sid

    def get(self, sid: str) -> Session | None:
        with self._lock:
            return self._sessions.get(sid)

    def touch(self, sid: str) -> bool:
        """Record a heartbeat; False for an unknown (or freed) session."""
        with self._lock:
            s = self._sessions.get(sid)
            if s is None or s.finished:
                return False
            s.last_seen = time.monotonic()
            return True

    def finish(self, sid: str) -> bool:
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:
                return False
            s.finished = True
            return True

    def reap(self) -> list[Session]:
        """Remove and return the finished sessions and those silent for longer than `timeout_s`."""
        cutoff = time.monotonic() - self.timeout_s
        with self._lock:
            gone = [s for s in self._sessions.values() if s.finished or s.last_seen < cutoff]
            for s in gone:
                del self._sessions[s.session_id]
        return gone
