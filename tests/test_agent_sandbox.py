"""The Python sandbox: no network, no writes outside scratch, limits, truncation, fail-closed."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hybridflow.agent.loop.tools import TOOLS, run_tool
from hybridflow.agent.loop.tools import sandbox as sb
from hybridflow.agent.loop.tools.sandbox import SandboxConfig, SandboxUnavailableError, run_python


def _available() -> bool:
    """False only where the kernel refuses the namespaces (no privilege); any later setup failure
    is a bug and fails the tests instead of skipping them."""
    try:
        return run_python("print(1)").stdout == "1\n"
    except SandboxUnavailableError as exc:
        if "unshare namespaces" in str(exc):
            return False
        raise


pytestmark = pytest.mark.skipif(not _available(), reason="namespaces refused here (test_fails_closed covers this)")
FAST = SandboxConfig(wall_seconds=5, cpu_seconds=3)


def test_runs_code_and_can_write_its_scratch_dir():
    result = run_python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), 6 * 7)", FAST)
    assert (result.stdout, result.exit_code, result.ok) == ("hi 42\n", 0, True)


def test_network_connection_is_refused_even_to_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    result = run_python(code, FAST)
    server.close()
    assert "connected" not in result.stdout and result.exit_code == 1
    assert "OSError" in result.stderr and not accepted
    # the same connection from outside the sandbox succeeds, so the refusal is the sandbox's
    probe = socket.create_server(("127.0.0.1", 0))
    socket.create_connection(probe.getsockname(), timeout=2).close()
    probe.close()


def test_unix_sockets_of_the_host_are_unreachable(tmp_path):
    path = tmp_path / "server.sock"  # under /tmp, like Ray's session sockets
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\nprint('connected')"
    result = run_python(code, FAST)
    assert "connected" not in result.stdout and "FileNotFoundError" in result.stderr, result
    client = socket.socket(socket.AF_UNIX)
    client.connect(str(path))  # reachable from outside the sandbox
    client.close()
    server.close()


def test_writes_outside_scratch_fail(tmp_path):
    target = tmp_path / "escaped.txt"
    for path in (target, "/tmp/hf_sandbox_escape.txt"):
        code = f"import os\nos.makedirs(os.path.dirname({str(path)!r}), exist_ok=True)\nopen({str(path)!r}, 'w')"
        result = run_python(code, FAST)
        assert result.exit_code == 1 and "Read-only file system" in result.stderr, result
    assert not target.exists()
    assert not __import__("os").path.exists("/tmp/hf_sandbox_escape.txt")


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    config = SandboxConfig(wall_seconds=1.0, cpu_seconds=30)
    start = time.monotonic()
    result = run_python("while True:\n    pass", config)
    assert time.monotonic() - start < 4
    assert result.timed_out and not result.ok and result.exit_code == 128 + 9
    text = run_tool(TOOLS.get("python")(config), {"code": "while True: pass"}).text
    assert "killed: wall-clock limit" in text


def test_cpu_limit_kills_a_busy_child_and_its_forks():
    code = "import os\nos.fork()\nwhile True:\n    pass"  # the fork shares the CPU rlimit, not the clock
    result = run_python(code, SandboxConfig(wall_seconds=60, cpu_seconds=1))  # the clock is generous: shared cores
    assert not result.timed_out and result.exit_code in (128 + 24, 128 + 9)  # SIGXCPU, or SIGKILL a second later


def test_forked_sleeper_does_not_outlive_the_call():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    start = time.monotonic()
    result = run_python(code, FAST)
    assert result.stdout == "parent done\n" and time.monotonic() - start < 4


def test_a_megabyte_of_output_is_truncated():
    config = SandboxConfig(wall_seconds=5, max_output_chars=100)
    result = run_python("import sys\nsys.stdout.write('x' * (1 << 20))", config)
    assert result.ok and result.truncated and result.stdout == "x" * 100


def test_memory_limit():
    result = run_python("b = bytearray(2 << 30)\nprint('allocated')", SandboxConfig(memory_bytes=512 << 20))
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_a_crash_costs_only_that_call():
    crashed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", FAST)
    assert crashed.exit_code == 128 + 11
    assert run_python("print('still fine')", FAST).stdout == "still fine\n"


def test_fails_closed_when_namespaces_are_refused(monkeypatch):
    real = sb._jail_config
    monkeypatch.setattr(sb, "_jail_config", lambda c, s: {**real(c, s), "namespaces": 0x1})  # EINVAL
    with pytest.raises(SandboxUnavailableError, match="unshare namespaces"):
        run_python("open('/tmp/hf_should_not_run', 'w')", FAST)
    with pytest.raises(SandboxUnavailableError):
        run_tool(TOOLS.get("python")(FAST), {"code": "print(1)"})
