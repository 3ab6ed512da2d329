"""Dedicated unprivileged uids for sandboxed calls: one uid per running call, on the whole host.

`dedicated_uid(first, count)` holds an exclusive `flock` on `<tmp>/hybridflow-sandbox-uids/<uid>.lock` for
the first free uid of `first .. first + count - 1` while the call runs, so two calls (threads, worker
processes) never share one: RLIMIT_NPROC, which the kernel counts per uid, then counts exactly one
call's process tree. Before the lock is released every process still running under the uid is
SIGKILLed (`kill_uid`), so nothing of a call survives into the next call that gets the same uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir(), "hybridflow-sandbox-uids")


class NoFreeUidError(RuntimeError):
    """Every uid of the range is in use by a running call."""


@contextlib.contextmanager
def dedicated_uid(first: int, count: int) -> Iterator[int]:
    """A uid of `first .. first+count-1` no other call uses until the block ends (module docstring)."""
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    start = os.getpid() % count  # spread concurrent workers over the range
    for k in range(count):
        uid = first + (start + k) % count
        fd = os.open(LOCK_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            kill_uid(uid)  # a leftover of a call whose trainer died
            yield uid
        finally:
            kill_uid(uid)
            os.close(fd)
        return
    raise NoFreeUidError(f"all {count} sandbox uids from {first} are in use by running calls")


def processes_of(uid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose real uid is `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as fh:
                for line in fh:
                    if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                        break  # exited; its parent reaps it
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(entry.name))
                        break
        except OSError:  # exited meanwhile
            continue
    return pids


def kill_uid(uid: int, rounds: int = 50) -> None:
    """SIGKILL every process of `uid` until none is left (a forking tree needs a few rounds)."""
    for _ in range(rounds):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
