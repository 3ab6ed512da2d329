"""Answers to resent requests: the SDK resends a request whose answer it did not get (a timeout, a dropped
connection) with the same `X-Idempotency-Key`. Running it again would queue the work twice, and a training
call's second copy would carry a seq_id already taken (an "out of order" error for a call that ran fine), so
a resent request gets the answer the first copy got.

Answers are kept for `KEEP_S` (as long as the futures they name) and at most `MAX_KEYS` of them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

KEEP_S = 600.0
"""How long an answer is replayed for its key."""
MAX_KEYS = 100_000
"""Most answers kept; the oldest go first."""


class Replays:
    """Idempotency key -> the JSON answer its first request got (module docstring). Thread-safe."""

    def __init__(self, keep_s: float = KEEP_S, max_keys: int = MAX_KEYS) -> None:
        self.keep_s, self.max_keys = keep_s, max_keys
        self.replayed = 0
        """Requests answered from here (for logs and tests)."""
        self._lock = threading.Lock()
        self._answers: OrderedDict[str, tuple[Any, float]] = OrderedDict()

    def get(self, key: str) -> Any | None:
        """The answer kept for `key`, or None."""
        with self._lock:
            self._prune()
            hit = self._answers.get(key)
            if hit is None:
                return None
            self.replayed += 1
            return hit[0]

    def put(self, key: str, answer: Any) -> None:
        with self._lock:
            self._answers[key] = (answer, time.monotonic())
            self._prune()

    def _prune(self) -> None:
        cutoff = time.monotonic() - self.keep_s
        while self._answers and (len(self._answers) > self.max_keys or next(iter(self._answers.values()))[1] < cutoff):
            self._answers.popitem(last=False)
