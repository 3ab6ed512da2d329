"""Worker faults: a worker kills itself (or hangs) at a precise call, exactly once.

A spec is comma-separated points `METHOD@STEP:RANK[:ACTION]`, e.g. "update_actor@4:0,save_checkpoint@2:1:hang":
when rank RANK of any worker group enters the `@register` method METHOD for training step STEP (the hook point
`worker.method_entered`), it SIGKILLs its own process (ACTION `kill`, the default: what an OOM kill or a segfault
looks like from outside) or sleeps forever (`hang`: a deadlocked rank, for the call and collective timeouts). The
step of a call is the `global_step` in the meta_info of its DataProto argument, or the N of a `global_step_N` path
argument (checkpoint save and load); calls without a step (validation, model loading) never match.

Exactly once: before acting, the rank creates `<marker_dir>/<point>` with O_EXCL, so the restarted worker that
redoes the step, and a rerun of the same command, pass the point unharmed. With the local backend the worker is
the controller's own process, which a `kill` point ends.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ACTIONS = ("kill", "hang")
_POINT_RE = re.compile(r"^(?P<method>\w+)@(?P<step>\d+):(?P<rank>\d+)(?::(?P<action>\w+))?$")
_STEP_IN_PATH_RE = re.compile(r"global_step_(\d+)")


@dataclass(frozen=True)
class FaultPoint:
    """Where one injected fault fires."""

    method: str
    """The worker method's name (as the role class defines it, e.g. generate_sequences)."""
    step: int
    """The training step of the call."""
    rank: int
    """The rank (RANK) that fails."""
    action: str
    """"kill": SIGKILL the process; "hang": sleep forever."""

    @property
    def marker_name(self) -> str:
        """File name of this point's once-marker."""
        return f"{self.method}@{self.step}:{self.rank}:{self.action}"


def parse_faults(spec: str) -> tuple[FaultPoint, ...]:
    """The points of a spec; a malformed one raises naming the expected form."""
    points = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = _POINT_RE.match(part)
        action = (match and match["action"]) or "kill"
        if not match or action not in ACTIONS:
            raise ValueError(f"bad fault point {part!r}; expected METHOD@STEP:RANK[:kill|hang], e.g. update_actor@3:1")
        points.append(FaultPoint(match["method"], int(match["step"]), int(match["rank"]), action))
    return tuple(points)


def call_step(args: tuple, kwargs: dict) -> int | None:
    """The training step a call belongs to (see the module docstring), or None."""
    for value in (*args, *kwargs.values()):
        meta = getattr(value, "meta_info", None)
        if isinstance(meta, dict) and "global_step" in meta:
            return int(meta["global_step"])
        if isinstance(value, (str, os.PathLike)):
            match = _STEP_IN_PATH_RE.search(os.fspath(value))
            if match:
                return int(match.group(1))
    return None


def method_entered_hook(spec: str, marker_dir: str | Path) -> Callable[..., None]:
    """The hook for `worker.method_entered` that acts on the points of `spec`, each once (markers in `marker_dir`)."""
    by_method: dict[str, list[FaultPoint]] = {}
    for point in parse_faults(spec):
        by_method.setdefault(point.method, []).append(point)

    def hook(method: str, args: tuple, kwargs: dict) -> None:
        points = by_method.get(method)
        if not points:
            return
        step, rank = call_step(args, kwargs), int(os.environ.get("RANK", "0"))
        for point in points:
            if point.step == step and point.rank == rank and _claim(point, Path(marker_dir)):
                _act(point)

    return hook


def _claim(point: FaultPoint, marker_dir: Path) -> bool:
    """Create the point's once-marker; False when another process (or an earlier run) already did."""
    marker_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(marker_dir / point.marker_name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, f"pid {os.getpid()} at {time.time():.3f}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


def _act(point: FaultPoint) -> None:
    if point.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: a rank that never returns and never joins its peers' collectives
        time.sleep(3600)
