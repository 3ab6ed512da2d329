"""The Python sandbox: running code, limits, truncation, fail-closed (the escape attempts: test_sandbox_escape.py)."""

from __future__ import annotations

import time

import pytest

from hybridflow.agent.loop.tools import TOOLS, run_tool
from hybridflow.agent.loop.tools import sandbox as sb
from hybridflow.agent.loop.tools.sandbox import SandboxConfig, SandboxUnavailableError, run_python
from tests.sandbox_required import machine_problem

needs_sandbox = pytest.mark.skipif(machine_problem() is not None, reason=f"no sandbox here: {machine_problem()}")
FAST = SandboxConfig(timeout_s=5, cpu_seconds=3)


@needs_sandbox
def test_runs_code_and_can_write_its_scratch_dir():
    result = run_python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), 6 * 7)", FAST)
    assert (result.stdout, result.exit_code, result.ok) == ("hi 42\n", 0, True)


@needs_sandbox
def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    config = SandboxConfig(timeout_s=1.0, cpu_seconds=30)
    start = time.monotonic()
    result = run_python("while True:\n    pass", config)
    assert time.monotonic() - start < 4
    assert result.timed_out and not result.ok and result.exit_code == 128 + 9
    text = run_tool(TOOLS.get("python")(config), {"code": "while True: pass"}).text
    assert "killed: wall-clock limit" in text


@needs_sandbox
def test_cpu_limit_kills_a_busy_child_and_its_forks():
    code = "import os\nos.fork()\nwhile True:\n    pass"  # the fork shares the CPU rlimit, not the clock
    result = run_python(code, SandboxConfig(timeout_s=60, cpu_seconds=1))  # the clock is generous: shared cores
    assert not result.timed_out and result.exit_code in (128 + 24, 128 + 9)  # SIGXCPU, or SIGKILL a second later


@needs_sandbox
def test_forked_sleeper_does_not_outlive_the_call():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    start = time.monotonic()
    result = run_python(code, FAST)
    assert result.stdout == "parent done\n" and time.monotonic() - start < 4


@needs_sandbox
def test_a_megabyte_of_output_is_truncated():
    config = SandboxConfig(timeout_s=5, max_output_chars=100)
    result = run_python("import sys\nsys.stdout.write('x' * (1 << 20))", config)
    assert result.ok and result.truncated and result.stdout == "x" * 100


@needs_sandbox
def test_memory_limit():
    result = run_python("b = bytearray(2 << 30)\nprint('allocated')", SandboxConfig(memory_bytes=512 << 20))
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


@needs_sandbox
def test_a_crash_costs_only_that_call():
    crashed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", FAST)
    assert crashed.exit_code == 128 + 11
    assert run_python("print('still fine')", FAST).stdout == "still fine\n"


def test_fails_closed_without_bubblewrap(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        run_python("open('/tmp/hf_should_not_run', 'w')", FAST)
    with pytest.raises(SandboxUnavailableError):
        run_tool(TOOLS.get("python")(FAST), {"code": "print(1)"})


def test_fails_closed_when_not_root(monkeypatch):
    monkeypatch.setattr(sb.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailableError, match="needs root"):
        run_python("print(1)", FAST)


@needs_sandbox
def test_code_cannot_pass_itself_off_as_a_setup_failure():
    result = run_python("import sys\nsys.stderr.write('bwrap: Unknown option\\n')\nsys.exit(97)", FAST)
    assert (result.exit_code, result.stderr) == (97, "bwrap: Unknown option\n")


@needs_sandbox
def test_readonly_paths_are_importable_and_read_only(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    tmp_path.chmod(0o755)
    config = SandboxConfig(timeout_s=5, readonly_paths=[str(tmp_path)])
    code = f"import helper_mod\nprint(helper_mod.VALUE)\nopen({str(tmp_path / 'w')!r}, 'w')"
    result = run_python(code, config)
    assert result.stdout == "7\n" and "Read-only file system" in result.stderr, result
    assert not (tmp_path / "w").exists()


def test_config_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="sandbox.tree_limits"):
        SandboxConfig(tree_limits="none")
    with pytest.raises(ValueError, match="sandbox.first_uid"):
        SandboxConfig(first_uid=0)
    with pytest.raises(ValueError, match="sandbox.readonly_paths"):
        SandboxConfig(readonly_paths=["relative/dir"])
    with pytest.raises(ValueError, match="less than 32 MiB per process after sandbox.scratch_bytes"):
        SandboxConfig(memory_bytes=256 << 20, max_processes=8)
    with pytest.raises(ValueError, match="chmod o\\+rx"):
        SandboxConfig(readonly_paths=[str(tmp_path)])  # pytest makes it 0700


@needs_sandbox
def test_concurrent_calls_run_under_different_uids():
    from concurrent.futures import ThreadPoolExecutor

    code = "import os, time\ntime.sleep(0.5)\nprint(os.getuid())"
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: run_python(code, FAST), range(6)))
    assert all(r.ok for r in results), results
    assert len({int(r.stdout) for r in results}) == 6
