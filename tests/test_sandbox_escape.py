"""The sandbox escape suite (issue 56): a hostile program tries each way out of the python tool's sandbox, and
every attempt is refused, under both kinds of tree limits (a cgroup, and the dedicated uid's rlimits), while
the calculator and python tools still work.

Each attempt is a real program run through `run_python`; where a refusal could be vacuous (a connection to a
port nobody listens on) the test shows the same action succeeds from outside the sandbox.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from hybridflow.agent.loop.tools import TOOLS, _cgroup, run_tool
from hybridflow.agent.loop.tools.sandbox import SandboxConfig, run_python
from hybridflow.utils.cache import cache_root
from tests.sandbox_required import require_sandbox

require_sandbox()

MODES = [
    "rlimit",
    pytest.param(
        "cgroup",
        marks=pytest.mark.skipif(_cgroup.unavailable_reason() is not None, reason=str(_cgroup.unavailable_reason())),
    ),
]


def _config(mode: str, **kw) -> SandboxConfig:
    return SandboxConfig(**{"timeout_s": 20, "cpu_seconds": 10, "tree_limits": mode, **kw})


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture
def planted():
    """A secret file in $HOME, in the task cache (where the parquet answers live) and in the run directory."""
    token = uuid.uuid4().hex
    places = [Path.home() / f".hf-escape-{token}", cache_root() / "data" / f"hf-escape-{token}.parquet"]
    places.append(Path.cwd() / f".hf-escape-{token}")
    for path in places:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"answer {token}")
    yield token, places
    for path in places:
        path.unlink(missing_ok=True)


def test_tools_still_work(mode):
    assert run_tool(TOOLS.get("calculator")(), {"expression": "12 * 34"}).text == "408"
    python = TOOLS.get("python")(_config(mode))
    result = run_tool(python, {"code": "import math, json\nprint(json.dumps([math.factorial(10), 2**10]))"})
    assert (result.text, result.ok) == ("[3628800, 1024]\n", True)


def test_cannot_read_home_task_cache_or_run_directory(mode, planted):
    token, places = planted
    for path in places + [Path.home(), cache_root(), Path.cwd()]:
        code = (
            "import os, sys\n"
            f"p = {str(path)!r}\n"
            "try:\n    print(os.listdir(p) if os.path.isdir(p) else open(p).read())\n"
            "except OSError as e:\n    print('refused', type(e).__name__)\n"
        )
        result = run_python(code, _config(mode))
        assert result.ok and token not in result.stdout, (path, result)
        assert result.stdout.startswith("refused") or path == Path.home(), (path, result)
        if path == Path.home():  # only the interpreter's directory may show through (/root/.pyenv)
            assert not any(p.name in result.stdout for p in places), result
    assert all(token in p.read_text() for p in places)  # readable from outside: the refusal is the sandbox's


def test_does_not_run_as_root(mode):
    result = run_python("import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())", _config(mode))
    uid, euid, gid, groups = result.stdout.split(maxsplit=3)
    assert int(uid) >= 1000 and uid == euid == gid and groups.strip() == "[]", result
    # the same uid outside: the runner's process, seen from the host, is not root either
    seen: list[int] = []

    def look():
        for _ in range(200):
            seen.extend(_host_uids_of_runners())
            if seen:
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=look)
    watcher.start()
    run_python("import time\ntime.sleep(3)", _config(mode))
    watcher.join()
    assert seen and all(u >= 1000 for u in seen), seen


def _host_uids_of_runners() -> list[int]:
    """Real uids, in the host's namespace, of the interpreters running the sandbox's runner."""
    uids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue
            if b"/hf/runner.py" in argv and os.path.basename(argv[0]).startswith(b"python"):
                uids.append(int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1]))
    return uids


FORK_BOMB = """
import os, time
n = 1
for _ in range(40):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
    except OSError as exc:
        print('refused', exc.errno)
        break
print('processes', n)
"""


def test_cannot_fork_past_the_process_limit(mode):
    result = run_python(FORK_BOMB, _config(mode, max_processes=4))
    assert "refused" in result.stdout, result
    assert int(result.stdout.split()[-1]) <= 4, result


def test_tree_memory_is_bounded(mode):
    # four children each touch 96 MB and hold it for 2 s: 384 MB in all, under a 200 MB tree limit
    code = """
import os
kids = []
for _ in range(4):
    try:
        pid = os.fork()
    except OSError:
        print('fork refused', flush=True)
        break
    if pid == 0:
        try:
            b = bytearray(96 << 20)
            b[::4096] = b'x' * len(b[::4096])
            import time; time.sleep(2)
            os.write(1, b'ok\\n')  # only a child that held its 96 MB for the whole 2 s says ok
        except MemoryError:
            os.write(1, b'memoryerror\\n')
        os._exit(0)
    kids.append(pid)
print('statuses', [os.waitpid(p, 0)[1] for p in kids], flush=True)
"""
    limited = _config(mode, memory_bytes=200 << 20, scratch_bytes=8 << 20, max_processes=5)
    result = run_python(code, limited)  # the tree would need 384 MB
    assert "statuses" in result.stdout and result.stdout.count("ok") < 3, result
    roomy = _config(mode, memory_bytes=3 << 30, scratch_bytes=8 << 20, max_processes=5)
    result = run_python(code, roomy)  # the same program within a limit that allows it
    assert result.stdout.count("ok") == 4, result


def test_cannot_fill_the_disk(mode):
    code = """
import os
written = 0
try:
    for i in range(23):
        with open(f'f{i}', 'wb') as fh:
            fh.write(b'x' * (16 << 20))
        written += 16 << 20
except OSError as exc:
    print('refused', exc.errno, written)
print(open('/proc/self/mounts').read())
"""
    result = run_python(code, _config(mode, scratch_bytes=32 << 20, memory_bytes=512 << 20))
    assert "refused 28" in result.stdout, result  # ENOSPC
    assert int(result.stdout.split()[2]) <= 32 << 20
    assert any(line.startswith("tmpfs /scratch tmpfs") for line in result.stdout.splitlines()), result


def test_cannot_reach_loopback_or_host_sockets(mode, tmp_path):
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "ray.sock"))  # a Unix socket in a temp dir, like Ray's session sockets
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0hf-escape-" + uuid.uuid4().hex.encode())
    for s in (tcp, unix, abstract):
        s.listen()
    targets = [
        ("AF_INET", ("127.0.0.1", tcp.getsockname()[1])),
        ("AF_UNIX", str(tmp_path / "ray.sock")),
        ("AF_UNIX", abstract.getsockname()),
    ]
    try:
        for family, address in targets:
            code = (
                "import socket\n"
                f"s = socket.socket(socket.{family})\ns.settimeout(2)\n"
                f"try:\n    s.connect({address!r})\n    print('connected')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)\n"
            )
            result = run_python(code, _config(mode))
            assert result.stdout.startswith("refused"), (address, result)
            outside = socket.socket(getattr(socket, family))
            outside.connect(address)  # reachable from outside
            outside.close()
    finally:
        for s in (tcp, unix, abstract):
            s.close()


def test_cannot_write_outside_scratch_or_to_dev(mode, tmp_path):
    for path in (tmp_path / "escaped", "/tmp/hf-escape", "/escaped", "/usr/escaped", "/dev/escaped", "/proc/escaped"):
        code = f"try:\n    open({str(path)!r}, 'w').write('x')\n    print('written')\nexcept OSError as e:\n    print('refused', e.errno)"
        result = run_python(code, _config(mode))
        assert result.stdout.startswith("refused"), (path, result)
    assert not (tmp_path / "escaped").exists() and not os.path.exists("/tmp/hf-escape")
    result = run_python("import os\nprint(sorted(os.listdir('/dev')))", _config(mode))
    assert not {"sda", "vda", "mem", "kmsg", "nvidia0"} & set(eval(result.stdout)), result


def test_cannot_signal_or_ptrace_a_process_outside(mode):
    code = f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
try:
    os.kill({os.getpid()}, signal.SIGKILL)
    print('killed')
except OSError as e:
    print('kill refused', e.errno)
print('ptrace', libc.ptrace(16, {os.getpid()}, 0, 0), ctypes.get_errno())
print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
"""
    result = run_python(code, _config(mode))
    assert "kill refused 3" in result.stdout and "ptrace -1 3" in result.stdout, result  # ESRCH: not visible
    assert max(eval(result.stdout.splitlines()[-1])) < 10  # only the sandbox's own PID namespace


def test_cannot_mount_or_create_a_user_namespace(mode):
    code = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print('mount', libc.mount(b'tmpfs', b'/usr', b'tmpfs', 0, None), ctypes.get_errno())
print('userns', libc.unshare(0x10000000), ctypes.get_errno())
print('mountns', libc.unshare(0x00020000), ctypes.get_errno())
"""
    result = run_python(code, _config(mode))
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert all(value.startswith("-1 ") for value in lines.values()), result


def test_cannot_read_the_trainers_environment(mode, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("HF_ESCAPE_SECRET", secret)
    code = (
        "import os\nprint(dict(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n            print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "        except OSError as e:\n            print(pid, 'refused')\n"
    )
    result = run_python(code, _config(mode))
    assert result.ok and secret not in result.stdout and "HF_ESCAPE_SECRET" not in result.stdout, result
    assert os.environ["HF_ESCAPE_SECRET"] == secret
