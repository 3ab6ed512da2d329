"""A process sandbox for model-written Python: namespaces, read-only mounts, limits, a hard kill.

`run_python(code, config)` writes `code` to a fresh scratch directory and runs it in a child
process (`_jail.py`, see its docstring for the isolation steps) that:
- has no network (an empty network namespace: connecting anywhere, 127.0.0.1 included, fails);
- can write only inside its scratch directory (every other mount is read-only in its private
  mount namespace; the scratch directory is deleted after the call);
- runs under RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC and RLIMIT_FSIZE, and a wall-clock limit after
  which its whole process group is SIGKILLed (and with it the PID namespace, so processes the
  code forked die too);
- returns at most `max_output_chars` of stdout and of stderr (the rest is read and dropped, so a
  child printing without end never blocks nor fills memory).

Isolation needs the Linux namespace syscalls with CAP_SYS_ADMIN (root in a container, as on
these machines and in CI). Where they are refused, the call raises `SandboxUnavailableError`:
the sandbox fails closed and never runs code unisolated.

Departure from verl: verl's `SandboxFusionTool` sends code to an external sandbox service; this
sandbox is local and needs no service.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hybridflow.agent.loop.tools.base import ToolSetupError

_JAIL = Path(__file__).with_name("_jail.py")
UNAVAILABLE_EXIT = 97  # _jail.UNAVAILABLE; _jail is run as a script, not imported


class SandboxUnavailableError(ToolSetupError):
    """The isolation primitives are refused on this machine; no code was run."""


@dataclass
class SandboxConfig:
    """Limits of one sandboxed call."""

    wall_seconds: float = 10.0
    """Wall-clock limit; then the process group is killed."""
    cpu_seconds: int = 5
    """RLIMIT_CPU of the child (SIGXCPU / SIGKILL past it)."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS of the child (the interpreter itself takes ~100 MB of it)."""
    max_processes: int = 64
    """RLIMIT_NPROC (per uid, so concurrent calls share it)."""
    max_file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: the largest file the code may write in its scratch directory."""
    max_output_chars: int = 4096
    """Characters of stdout and of stderr returned; more is dropped and marked truncated."""
    scratch_root: str | None = None
    """Directory under which each call's scratch directory is made (None: the system temp dir)."""

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "max_processes", "max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_output_chars < 0:
            raise ValueError(f"SandboxConfig.max_output_chars must be >= 0, got {self.max_output_chars}")


@dataclass
class SandboxResult:
    """The outcome of one sandboxed run."""

    stdout: str
    stderr: str
    exit_code: int
    """The child's exit status; 128 + N when killed by signal N."""
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
    """Run `code` in the sandbox (module docstring); raises SandboxUnavailableError if it cannot isolate."""
    config = config or SandboxConfig()
    scratch = tempfile.mkdtemp(prefix="hf-sandbox-", dir=config.scratch_root)
    try:
        Path(scratch, "main.py").write_text(code)
        return _run_jail(_jail_config(config, os.path.realpath(scratch)), config)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _jail_config(config: SandboxConfig, scratch: str) -> dict:
    return {
        "scratch": scratch,
        "cpu_seconds": config.cpu_seconds,
        "memory_bytes": config.memory_bytes,
        "max_processes": config.max_processes,
        "max_file_bytes": config.max_file_bytes,
    }


def _run_jail(jail_cfg: dict, config: SandboxConfig) -> SandboxResult:
    proc = subprocess.Popen(
        [sys.executable, "-I", str(_JAIL), json.dumps(jail_cfg)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, killed as one
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    # Bytes may be up to 4 per character; cut to characters after decoding.
    out, err = (_Capped(s, 4 * config.max_output_chars + 4) for s in (proc.stdout, proc.stderr))
    timed_out = False
    try:
        proc.wait(timeout=config.wall_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    stdout, stderr = out.text(), err.text()
    if proc.returncode == UNAVAILABLE_EXIT and stderr.startswith("sandbox unavailable"):
        raise SandboxUnavailableError(
            f"{stderr.strip()}; the Python sandbox needs Linux namespaces (CAP_SYS_ADMIN, e.g. root in a "
            "container) and refuses to run code without them"
        )
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    cut = len(stdout) > config.max_output_chars or len(stderr) > config.max_output_chars
    truncated = out.dropped or err.dropped or cut
    return SandboxResult(
        stdout[: config.max_output_chars], stderr[: config.max_output_chars], code, timed_out, truncated
    )
