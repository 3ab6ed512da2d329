"""Whole-tree limits for one sandboxed call from a control group: processes, memory, CPU rate.

`TreeCgroup.create(name, limits)` makes one cgroup per call below this process's own cgroup, in the
unified hierarchy (cgroup v2: pids.max, memory.max with memory.swap.max=0, cpu.max) or in the v1
`pids` and `memory` hierarchies (pids.max, memory.limit_in_bytes and memory.memsw.limit_in_bytes) plus
`cpu` (cpu.cfs_quota_us) where mounted. The caller moves the call's first process into it
(`procs_files`) before that process forks; the kernel then counts every descendant, whatever it does.
`kill_and_remove()` SIGKILLs what is left and removes the cgroup.

`unavailable_reason()` says in one line why no such cgroup can be made here (no controller, a
read-only cgroup filesystem, cgroup v2 controllers not delegated to this process's cgroup), or None.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TreeLimits:
    """What the cgroup enforces for the whole tree."""

    max_processes: int
    memory_bytes: int
    cpu_cores: float


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fstype, super options) of every cgroup mount of this process."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if tail and tail[0] in ("cgroup", "cgroup2"):
            point = fields[4].encode().decode("unicode_escape")
            found.append((fields[3], point, tail[0], set(tail[2].split(",")) if len(tail) > 2 else set()))
    return found


def _own_paths() -> dict[str, str]:
    """Controller (or "" for the unified hierarchy) -> this process's cgroup path in it."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for ctrl in controllers.split(",") if controllers else [""]:
            paths[ctrl] = path
    return paths


def _join(point: str, root: str, path: str) -> Path:
    rel = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(point, rel.lstrip("/"))


def _v1_dirs() -> dict[str, Path]:
    """v1 controller -> the directory of this process's cgroup in it (pids, memory, cpu when mounted)."""
    own, dirs = _own_paths(), {}
    for root, point, fstype, opts in _mounts():
        for ctrl in ("pids", "memory", "cpu"):
            if fstype == "cgroup" and ctrl in opts and ctrl in own:
                dirs[ctrl] = _join(point, root, own[ctrl])
    if "cpu" in dirs and not os.access(dirs["cpu"], os.W_OK):
        del dirs["cpu"]  # optional: the CPU rate is then bounded by the wall clock and RLIMIT_CPU alone
    return dirs


def _v2_dir() -> Path | None:
    """The directory of this process's cgroup in the unified hierarchy, when that has pids and memory."""
    own = _own_paths().get("")
    for root, point, fstype, _ in _mounts():
        if fstype == "cgroup2" and own is not None:
            base = _join(point, root, own)
            controllers = (Path(point) / "cgroup.controllers").read_text().split()
            if {"pids", "memory"} <= set(controllers):
                return base
    return None


def _enable_v2(base: Path) -> str | None:
    """Delegate pids, memory (and cpu when offered) to `base`'s children; the failure, or None."""
    offered = set((base / "cgroup.controllers").read_text().split())
    wanted = [c for c in ("pids", "memory", "cpu") if c in offered]
    if not {"pids", "memory"} <= offered:
        return f"cgroup v2 at {base} does not offer the pids and memory controllers (offers {sorted(offered)})"
    enabled = set((base / "cgroup.subtree_control").read_text().split())
    missing = [c for c in wanted if c not in enabled]
    if missing:
        try:
            (base / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
        except OSError as exc:
            return f"cannot enable {missing} in {base}/cgroup.subtree_control ({exc.strerror})"
    return None


def unavailable_reason() -> str | None:
    """Why no per-call cgroup with pids and memory limits can be made here (module docstring); None if one can."""
    try:
        base = _v2_dir()
        if base is not None:
            problem = _enable_v2(base)
            return problem or _probe([base])
        dirs = _v1_dirs()
        missing = [c for c in ("pids", "memory") if c not in dirs]
        if missing:
            return f"no cgroup v2 with pids+memory and no cgroup v1 {missing} hierarchy mounted"
        return _probe([dirs["pids"], dirs["memory"]])
    except OSError as exc:
        return f"cannot read the cgroup setup: {exc}"


def _probe(bases: list[Path]) -> str | None:
    for base in bases:
        probe = base / f"hf-sandbox-probe-{os.getpid()}"
        try:
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            return f"cannot create a cgroup under {base} ({exc.strerror})"
    return None


class TreeCgroup:
    """One call's cgroup (module docstring)."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    @classmethod
    def create(cls, name: str, limits: TreeLimits) -> TreeCgroup:
        """A fresh cgroup `name` with `limits` (a leftover of the same name is emptied first); raises OSError."""
        base = _v2_dir()
        if base is not None:
            _enable_v2(base)
            group = cls([base / name])
            group._reset()
            _write(group.dirs[0], "pids.max", limits.max_processes)
            _write(group.dirs[0], "memory.max", limits.memory_bytes)
            _write(group.dirs[0], "memory.swap.max", 0, optional=True)
            period = 100_000
            _write(group.dirs[0], "cpu.max", f"{int(limits.cpu_cores * period)} {period}", optional=True)
            return group
        dirs = _v1_dirs()
        group = cls([dirs[c] / name for c in ("pids", "memory", "cpu") if c in dirs])
        group._reset()
        pids, memory = group.dirs[0], group.dirs[1]
        _write(pids, "pids.max", limits.max_processes)
        _write(memory, "memory.limit_in_bytes", limits.memory_bytes)
        _write(memory, "memory.memsw.limit_in_bytes", limits.memory_bytes, optional=True)
        if len(group.dirs) > 2:
            _write(group.dirs[2], "cpu.cfs_period_us", 100_000)
            _write(group.dirs[2], "cpu.cfs_quota_us", int(limits.cpu_cores * 100_000))
        return group

    @property
    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join this cgroup in every hierarchy."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def peak_memory(self) -> int | None:
        """The most memory the tree used (bytes), where the kernel reports it."""
        for d in self.dirs:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                if (d / name).exists():
                    return int((d / name).read_text())
        return None

    def _reset(self) -> None:
        if any(d.exists() for d in self.dirs):
            self.kill_and_remove()
        for d in self.dirs:
            d.mkdir()

    def kill_and_remove(self) -> None:
        """SIGKILL every process left in the cgroup, then remove it."""
        for d in self.dirs:
            for _ in range(100):
                pids = _pids(d)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.01)
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last killed process is reaped
                    time.sleep(0.01)


def _pids(d: Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _write(d: Path, name: str, value: object, optional: bool = False) -> None:
    if optional and not (d / name).exists():
        return
    (d / name).write_text(str(value))
