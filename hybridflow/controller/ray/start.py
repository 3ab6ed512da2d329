"""Starting a local Ray on a loaded machine.

Ray (2.60, ray/_private/node.py) waits a fixed 30 s for its new node to register with the GCS and then raises
"The current node timed out during startup"; no setting changes that wait. On a 2-core machine that other
programs keep busy the start can take longer. `start_ray` therefore retries within a total budget: after a
timed-out attempt it stops the processes that attempt started (its GCS, raylet and agents: the children this
process gained during it), then starts again. When the budget is spent it raises `RayStartTimeout` with the
machine's load, so the message says why and what to do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import psutil

NODE_TIMEOUT = "timed out during startup"
"""The text of Ray's error when its node did not register in time (what a retry may cure)."""


class RayStartTimeout(RuntimeError):
    """Ray did not start within the budget; one-line message."""


def start_ray(init: Callable[..., Any], budget_s: float, **kwargs: Any) -> None:
    """Call `init(**kwargs)` (ray.init) until it succeeds, retrying Ray's node-startup timeout while `budget_s`
    seconds have not passed since the first attempt; any other error is raised at once."""
    deadline = time.monotonic() + budget_s
    attempts = 0
    while True:
        attempts += 1
        before = _children()
        try:
            init(**kwargs)
            return
        except Exception as err:
            if NODE_TIMEOUT not in str(err):
                raise
            _stop(_children() - before)
            if time.monotonic() >= deadline:
                raise RayStartTimeout(
                    f"Ray did not start within {budget_s:g} s ({attempts} attempt(s); Ray gives its node 30 s each; "
                    f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): the machine is too busy; "
                    "close other programs or allow a longer start"
                ) from None


def _children() -> set[psutil.Process]:
    return set(psutil.Process().children(recursive=True))


def _stop(procs: set[psutil.Process]) -> None:
    """Terminate the processes a failed attempt left behind (then kill those still running after 5 s)."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs), timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
