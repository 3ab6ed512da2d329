"""A sandbox for model-written Python that holds for the whole process tree, built on bubblewrap.

`run_python(code, config)` runs `code` as `main.py` of a fresh scratch directory and returns what it
printed. The code:
- runs under a **dedicated unprivileged uid** (`first_uid ..`, one per running call on the host,
  `_uids.py`), the same number inside and outside its user namespace, with no capabilities,
  `no_new_privs`, and no way to create further user namespaces (bubblewrap's `--disable-userns`);
- sees a **minimal read-only root**: /usr (and the /bin, /lib, /lib64 links or directories), the
  trainer's base interpreter with its standard library (not the virtualenv, not its site-packages),
  the runner, the paths of `readonly_paths`, a fresh /proc of its own PID namespace, bubblewrap's
  minimal /dev (null, zero, full, random, urandom, tty, pts, shm). Nothing of $HOME, the caches, the
  run directory, checkpoints, /tmp or the trainer's environment variables exists in it;
- writes only its scratch directory (/scratch, the working directory and $HOME/$TMPDIR), a tmpfs of
  `scratch_bytes`: the host's disk is never written;
- has **no network**: an empty network namespace, so 127.0.0.1 (Ray's ports) and every other address
  refuse; no Unix socket of the host exists in its root;
- has **whole-tree limits** (`tree_limits`): with a cgroup (v2, or the v1 pids/memory/cpu hierarchies;
  `_cgroup.py`), pids.max = the tree's processes, the memory limit = the tree's memory (tmpfs scratch
  included, no swap), the CPU quota = `cpu_cores` of CPU rate. Without one ("rlimit"), RLIMIT_NPROC
  bounds the tree's processes (it counts per uid, and the uid is this call's alone; root, to which
  Linux does not apply it, never runs the code), and the memory is split: each process gets an
  address space (RLIMIT_AS) of `(memory_bytes - scratch_bytes) / max_processes`, so the tree with its
  scratch tmpfs stays within `memory_bytes` all the same (resident memory never exceeds address space).
  Both ways each process also has RLIMIT_CPU and RLIMIT_FSIZE (`_runner.py`), and the wall clock
  (`timeout_s`) kills the whole tree;
- returns at most `max_output_chars` of stdout and of stderr (the rest is read and dropped).

Nothing of a call outlives it: the wall clock SIGKILLs every process of its uid, the end of its PID
namespace's init ends the rest, and the uid is swept again before another call gets it. One gap: when the
trainer process itself is SIGKILLed mid-call, the unprivileged bubblewrap does not die with it (its
parent-death signal does not survive its start), so the call's processes run on, within their limits
(CPU seconds, the cgroup or the uid's process count, no network, no files outside their tmpfs), until
they end or the next call that gets the same uid kills them.

What it needs from the machine: root (to switch to the dedicated uid and build the root), bubblewrap
0.8 or newer (`apt-get install -y bubblewrap`; scripts/setup.sh installs it), setpriv (util-linux), user
namespaces for unprivileged users (`user.max_user_namespaces` > 0; Ubuntu also wants
`kernel.apparmor_restrict_unprivileged_userns=0`), and for the cgroup limits a writable cgroup
hierarchy. Where any is missing the call raises `SandboxUnavailableError` naming it and runs nothing.

How: two bubblewrap processes. The outer one runs as root without a user namespace: it can read an
interpreter under a private directory (/root/.pyenv) and builds a small root where the interpreter,
the runner and `readonly_paths` sit at world-readable places. setpriv then drops to the dedicated uid,
and the inner bubblewrap, unprivileged, makes the user, PID, network, IPC, UTS and cgroup namespaces,
the final read-only root and the scratch tmpfs. (A single bubblewrap as root would map the code's uid
to root outside, which RLIMIT_NPROC exempts; run unprivileged from the start it cannot reach an
interpreter in a 0700 home directory.)

Why bubblewrap and not our own namespace code (the previous `_jail.py`) or nsjail: bubblewrap is the
sandbox Flatpak ships, maintained and audited for exactly this (unprivileged user namespaces, a root
built from binds, `--disable-userns`, `--die-with-parent`), and a Debian package. nsjail (which also
does cgroups and seccomp) is not packaged in Debian 12, the base of these machines. The cgroup limits
and the dedicated uids are ours: bubblewrap leaves resource limits to its caller.

Departure from verl: verl's `SandboxFusionTool` sends code to an external sandbox service; this
sandbox is local and needs no service.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import hybridflow.agent.loop.tools._cgroup as _cgroup
import hybridflow.agent.loop.tools._uids as _uids
from hybridflow.agent.loop.tools._runner import READY
from hybridflow.agent.loop.tools.base import ToolSetupError
from hybridflow.utils.config_loader import Section

_RUNNER = Path(__file__).with_name("_runner.py")
UNAVAILABLE_EXIT = 97
MIN_PROCESS_BYTES = 32 << 20
"""The least address space a process may get (the interpreter starts in about 20 MiB)."""
TREE_LIMITS = ("auto", "cgroup", "rlimit")
"""SandboxConfig.tree_limits values."""
SANDBOX_PROCESSES = 1
"""Processes of the sandbox's uid counted by RLIMIT_NPROC in the code's user namespace besides the code's
own: bubblewrap's PID-namespace init."""
CGROUP_PROCESSES = 3
"""Processes in the call's cgroup besides the code's own: the outer bubblewrap, the inner one (run under the
sandbox's uid outside its namespaces) and the PID-namespace init."""
log = logging.getLogger(__name__)


class SandboxUnavailableError(ToolSetupError):
    """The sandbox cannot be set up on this machine (module docstring); no code was run."""


@dataclass
class SandboxConfig(Section):
    """Limits of one sandboxed python-tool call (rollout.multi_turn.sandbox; hybridflow/agent/loop/tools/sandbox.py)."""

    timeout_s: float = 10.0
    """Wall-clock seconds one call may run; then its whole process tree is killed."""
    cpu_seconds: int = 5
    """CPU seconds of each process of the call (RLIMIT_CPU: SIGXCPU at the limit, SIGKILL a second later)."""
    memory_bytes: int = 1 << 30
    """Memory of the call's whole process tree, scratch files included: the cgroup's limit (and each process's
    address space); without a cgroup each process's address space is (memory_bytes - scratch_bytes) / max_processes."""
    max_processes: int = 8
    """Processes (and threads) of the call's process tree, the code's interpreter included."""
    cpu_cores: float = 1.0
    """CPU rate of the call's process tree, in cores (the cgroup's CPU quota; where the cgroup has a cpu controller)."""
    max_file_bytes: int = 16 << 20
    """The largest file the code may write (RLIMIT_FSIZE)."""
    scratch_bytes: int = 64 << 20
    """Size of the scratch directory, a tmpfs (the code's working directory, the only place it can write)."""
    max_output_chars: int = 4096
    """Characters of stdout and of stderr returned; more is dropped and marked truncated."""
    tree_limits: str = "auto"
    """How the process/memory limits cover the whole tree: "cgroup" (a cgroup per call; fails closed where none
    can be made), "rlimit" (a dedicated uid's RLIMIT_NPROC, RLIMIT_AS per process), "auto" (cgroup where the
    machine allows, else rlimit)."""
    first_uid: int = 1_900_000_000
    """First of the uids the sandbox runs code under, one per running call; no account, container or other program
    on the host may use first_uid .. first_uid + uid_count - 1 (their processes would be killed). The default lies
    in the range systemd leaves unused (0x70000000-0x7FFFFFFF), above the usual /etc/subuid container ranges."""
    uid_count: int = 1024
    """How many uids from first_uid the sandbox may use: the most calls running at once on one host."""
    readonly_paths: list[str] = field(default_factory=list)
    """Host directories the code may read (bound read-only at the same path and put first on its sys.path), e.g.
    a site-packages directory; each must be readable by other users. The default root has the standard library only."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_seconds", "memory_bytes", "max_processes", "cpu_cores", "max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)}")
        if self.scratch_bytes < 4096:
            raise ValueError(f"sandbox.scratch_bytes must be >= 4096 (it holds main.py), got {self.scratch_bytes}")
        if self.process_bytes(cgroup=False) < MIN_PROCESS_BYTES:
            raise ValueError(
                f"sandbox.memory_bytes={self.memory_bytes} leaves less than {MIN_PROCESS_BYTES >> 20} MiB per process "
                f"after sandbox.scratch_bytes={self.scratch_bytes} for sandbox.max_processes={self.max_processes}; "
                "raise memory_bytes or lower the other two"
            )
        if self.max_output_chars < 0:
            raise ValueError(f"sandbox.max_output_chars must be >= 0, got {self.max_output_chars}")
        if self.tree_limits not in TREE_LIMITS:
            raise ValueError(f"sandbox.tree_limits must be one of {TREE_LIMITS}, got {self.tree_limits!r}")
        if self.first_uid < 1000 or self.uid_count < 1:
            raise ValueError(
                f"sandbox.first_uid must be >= 1000 (not a system account) and sandbox.uid_count >= 1, "
                f"got {self.first_uid} and {self.uid_count}"
            )
        for path in self.readonly_paths:
            if not os.path.isabs(path) or not os.path.isdir(path):
                raise ValueError(f"sandbox.readonly_paths: {path!r} is not an absolute path of a directory")
            if os.stat(path).st_mode & 0o005 != 0o005:
                raise ValueError(
                    f"sandbox.readonly_paths: {path!r} is not readable by other users (the code runs under an "
                    f"unprivileged uid); chmod o+rx {path}"
                )

    def process_bytes(self, cgroup: bool) -> int:
        """Each process's address space (RLIMIT_AS): memory_bytes under a cgroup, else its share (field docstring)."""
        return self.memory_bytes if cgroup else (self.memory_bytes - self.scratch_bytes) // self.max_processes


@dataclass
class SandboxResult:
    """The outcome of one sandboxed run."""

    stdout: str
    stderr: str
    exit_code: int
    """The code's exit status; 128 + N when signal N killed it."""
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the code ran to a zero exit within its limits."""
        return self.exit_code == 0 and not self.timed_out


class _Capped:
    """Reads a stream to its end in a thread, keeping only the first `limit` bytes."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self.limit, self.data, self.dropped = limit, bytearray(), False
        self.thread = threading.Thread(target=self._drain, args=(stream,), daemon=True)
        self.thread.start()

    def _drain(self, stream: IO[bytes]) -> None:
        while chunk := stream.read(65536):
            room = self.limit - len(self.data)
            self.data += chunk[: max(room, 0)]
            self.dropped |= len(chunk) > room

    def text(self) -> str:
        self.thread.join(timeout=5)
        return self.data.decode("utf-8", errors="replace")


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` in the sandbox (module docstring); raises SandboxUnavailableError where it cannot be set up."""
    config = config or SandboxConfig()
    check_machine()
    use_cgroup = _use_cgroup(config.tree_limits)
    try:
        with _uids.dedicated_uid(config.first_uid, config.uid_count) as uid:
            group = _make_cgroup(uid, config) if use_cgroup else None
            try:
                return _run(code, config, uid, group)
            finally:
                if group is not None:
                    group.kill_and_remove()
    except _uids.NoFreeUidError as exc:
        raise SandboxUnavailableError(f"python sandbox: {exc}; raise sandbox.uid_count") from None


def check_machine() -> None:
    """Raise SandboxUnavailableError naming what this machine lacks for the sandbox (module docstring)."""
    if os.geteuid() != 0:
        raise SandboxUnavailableError(
            "the python sandbox runs code under a dedicated unprivileged uid and needs root to switch to it "
            "(run the trainer as root, e.g. in a container); it never runs code unsandboxed"
        )
    for tool, package in (("bwrap", "bubblewrap"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            raise SandboxUnavailableError(
                f"the python sandbox needs {tool} on PATH: apt-get install -y {package} (scripts/setup.sh does it)"
            )


@functools.cache
def _cgroup_problem() -> str | None:
    return _cgroup.unavailable_reason()


def _use_cgroup(mode: str) -> bool:
    if mode == "rlimit":
        return False
    problem = _cgroup_problem()
    if problem and mode == "cgroup":
        raise SandboxUnavailableError(
            f"sandbox.tree_limits=cgroup but no cgroup can be made here: {problem}; "
            "set rollout.multi_turn.sandbox.tree_limits=rlimit (or auto) to bound the tree by a dedicated uid's "
            "RLIMIT_NPROC and a share of memory_bytes per process"
        )
    if problem:
        _warn_fallback(problem)
    return problem is None


@functools.cache
def _warn_fallback(problem: str) -> None:
    log.warning(
        "python sandbox: no cgroup (%s); the process tree is bounded by the dedicated uid's RLIMIT_NPROC, "
        "its memory by giving each process (memory_bytes - scratch_bytes) / max_processes of address space",
        problem,
    )


def _make_cgroup(uid: int, config: SandboxConfig) -> _cgroup.TreeCgroup:
    limits = _cgroup.TreeLimits(config.max_processes + CGROUP_PROCESSES, config.memory_bytes, config.cpu_cores)
    try:
        return _cgroup.TreeCgroup.create(f"hf-sandbox-{uid}", limits)
    except OSError as exc:
        raise SandboxUnavailableError(f"python sandbox: cannot set up its cgroup: {exc}") from None


def _root_binds() -> list[str]:
    """bwrap arguments for /usr and the top-level links or directories into it, as the host has them."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/", name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def _interpreter() -> tuple[Path, Path]:
    """(the base interpreter's prefix, its executable): the trainer's Python without its virtualenv."""
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    return Path(os.path.realpath(sys.base_prefix)), exe


def sandbox_argv(config: SandboxConfig, uid: int, cgroup: bool) -> list[str]:
    """The command that runs `/scratch/main.py` (read from stdin) in the sandbox under `uid` (module docstring);
    `cgroup`: whether a cgroup bounds the tree (each process's address space depends on it)."""
    prefix, exe = _interpreter()
    in_usr = prefix == Path("/usr") or Path("/usr") in prefix.parents
    staged = [] if in_usr else [(str(prefix), "/hf/python", str(prefix))]
    staged.append((str(_RUNNER), "/hf/runner.py", "/hf/runner.py"))
    staged += [(p, f"/hf/ro{i}", p) for i, p in enumerate(config.readonly_paths)]
    outer = ["bwrap", "--die-with-parent", *_root_binds(), "--perms", "0755", "--dir", "/hf"]
    for host, stage, _ in staged:
        outer += ["--ro-bind", host, stage]
    outer += ["--bind", "/proc", "/proc", "--dev", "/dev", "--dir", "/tmp"]  # the inner bwrap mounts its own
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--no-new-privs"]
    inner = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(uid), "--gid", str(uid)]
    inner += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv", *_root_binds()]
    for _, stage, target in staged:
        inner += ["--ro-bind", stage, target]
    inner += ["--proc", "/proc", "--dev", "/dev", "--size", str(config.scratch_bytes), "--tmpfs", "/scratch"]
    inner += ["--file", "0", "/scratch/main.py", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/scratch"]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/scratch", "TMPDIR": "/scratch"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for key, value in env.items():
        inner += ["--setenv", key, value]
    limits = {
        "cpu_seconds": config.cpu_seconds,
        "memory_bytes": config.process_bytes(cgroup),
        "nproc": config.max_processes + SANDBOX_PROCESSES,
        "max_file_bytes": config.max_file_bytes,
        "paths": list(config.readonly_paths),
    }
    run = [str(exe), "-I", "-S", "/hf/runner.py", json.dumps(limits)]
    return [*outer, "--", *drop, "--", *inner, "--", *run]


def _join_cgroup(argv: list[str], group: _cgroup.TreeCgroup | None) -> list[str]:
    """`argv` started by a shell that first moves itself into `group` (so every descendant is in it)."""
    if group is None:
        return argv
    joins = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in group.procs_files)
    return ["/bin/sh", "-c", f'{joins} || exit {UNAVAILABLE_EXIT}; exec "$@"', "sh", *argv]


def _feed(stream: IO[bytes], data: bytes) -> None:
    try:
        stream.write(data)
        stream.close()
    except OSError:  # the sandbox died before reading its program
        pass


def _run(code: str, config: SandboxConfig, uid: int, group: _cgroup.TreeCgroup | None) -> SandboxResult:
    proc = subprocess.Popen(
        _join_cgroup(sandbox_argv(config, uid, group is not None), group),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"},
    )
    threading.Thread(target=_feed, args=(proc.stdin, code.encode()), daemon=True).start()
    # Bytes may be up to 4 per character; cut to characters after decoding.
    limit = 4 * config.max_output_chars + 4
    out, err = _Capped(proc.stdout, limit + len(READY)), _Capped(proc.stderr, limit)
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        _uids.kill_uid(uid)
        with contextlib.suppress(ProcessLookupError):  # the tree already ended with the uid's processes
            os.killpg(proc.pid, signal.SIGKILL)

    # A blocking wait and a timer, not wait(timeout=): that one polls with sleeps of up to 50 ms.
    timer = threading.Timer(config.timeout_s, kill)
    timer.start()
    proc.wait()
    timer.cancel()
    timer.join()
    timed_out = expired.is_set()
    stdout, stderr = out.text(), err.text()
    if not stdout.startswith(READY) and not timed_out:
        raise SandboxUnavailableError(_setup_failure(stderr, proc.returncode))
    stdout = stdout.removeprefix(READY)
    exit_code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    cut = len(stdout) > config.max_output_chars or len(stderr) > config.max_output_chars
    truncated = out.dropped or err.dropped or cut
    return SandboxResult(
        stdout[: config.max_output_chars], stderr[: config.max_output_chars], exit_code, timed_out, truncated
    )


def _setup_failure(stderr: str, returncode: int) -> str:
    text = stderr.strip() or f"exit code {returncode}, no message"
    hint = ""
    if "namespace" in text or "Operation not permitted" in text:
        hint = (
            "; the sandbox needs user namespaces for unprivileged users (sysctl user.max_user_namespaces > 0; "
            "on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0)"
        )
    elif "Unknown option" in text:
        hint = "; the sandbox needs bubblewrap 0.8 or newer"
    elif not stderr.strip():
        hint = " (killed before the interpreter started: is sandbox.memory_bytes large enough for it?)"
    return f"python sandbox could not start: {text}{hint}"
