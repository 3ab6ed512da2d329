"""Per-call cost of the python tool's sandbox: today's bubblewrap sandbox against the namespace jail it replaced.

    .venv/bin/python bench/sandbox.py                  # 20 calls of each program per variant
    .venv/bin/python bench/sandbox.py --calls 5        # a quick look

Variants, called in turn (old, new-rlimit, new-cgroup, old, ...) so load on a shared machine hits them alike:
- `old`: the sandbox of main at 7791ded (`hybridflow/agent/loop/tools/sandbox.py` + `_jail.py`, read with
  `git show` into a temporary directory and imported from there; it is not part of the package any more);
- `rlimit`: `run_python` with tree_limits=rlimit (a dedicated uid's RLIMIT_NPROC, RLIMIT_AS per process);
- `cgroup`: `run_python` with tree_limits=cgroup (skipped where no cgroup can be made).

Programs: `print` (prints 6 * 7: the sandbox's fixed cost) and `loop` (a pure-Python loop of ~0.1 s: the
cost where the code does some work). Prints the median and min wall time per call and each variant's
median as a ratio of the old one's. Needs root, bubblewrap and git (the old code comes from git history).
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hybridflow.agent.loop.tools import _cgroup
from hybridflow.agent.loop.tools.sandbox import SandboxConfig, run_python
from hybridflow.utils.hardware import cpu_signature

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "7791ded"
PROGRAMS = {"print": "print(6 * 7)", "loop": "s = 0\nfor i in range(2_000_000):\n    s += i\nprint(s)"}
EXPECTED = {"print": "42\n", "loop": f"{sum(range(2_000_000))}\n"}


def old_sandbox(workdir: Path):
    """The old sandbox module, imported from its files at OLD_COMMIT."""
    for name in ("sandbox.py", "_jail.py"):
        text = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:hybridflow/agent/" + f"tools/{name}"],  # its path before the house move
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        # the one import of the old module, at its place after the house move
        text = text.replace(b"from hybridflow.agent.tools.base import", b"from hybridflow.agent.loop.tools.base import")
        (workdir / name).write_bytes(text)
    spec = importlib.util.spec_from_file_location("hf_old_sandbox", workdir / "sandbox.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def variants(old) -> dict[str, Callable[[str], str]]:
    """Name -> a call running `code` and returning its stdout."""
    old_cfg = old.SandboxConfig(wall_seconds=30, cpu_seconds=20)
    found = {"old": lambda code: old.run_python(code, old_cfg).stdout}
    rlimit = SandboxConfig(timeout_s=30, cpu_seconds=20, tree_limits="rlimit")
    found["rlimit"] = lambda code: run_python(code, rlimit).stdout
    if _cgroup.unavailable_reason() is None:
        cgroup = SandboxConfig(timeout_s=30, cpu_seconds=20, tree_limits="cgroup")
        found["cgroup"] = lambda code: run_python(code, cgroup).stdout
    return found


SAME = ["print(6 * 7)", "1 / 0", "import sys\nprint('out')\nsys.exit(3)", "print(undefined_name)"]
"""Programs whose stdout, stderr and exit code must be the same under the old and the new sandbox."""


def same_outputs(old) -> bool:
    """True when the new sandbox returns what the old one did for every program of SAME."""
    old_cfg = old.SandboxConfig(wall_seconds=30)
    for code in SAME:
        a, b = old.run_python(code, old_cfg), run_python(code, SandboxConfig(timeout_s=30))
        if (a.stdout, a.stderr, a.exit_code) != (b.stdout, b.stderr, b.exit_code):
            print(f"differs on {code!r}: old {a} new {b}")
            return False
    return True


def measure(calls: int, runs: dict[str, Callable[[str], str]]) -> dict[tuple[str, str], list[float]]:
    """Wall seconds of every call, by (program, variant); variants interleaved call by call."""
    times: dict[tuple[str, str], list[float]] = {}
    for program, code in PROGRAMS.items():
        for run in runs.values():  # warm-up: page cache, the interpreter's files
            run(code)
        for _ in range(calls):
            for name, run in runs.items():
                start = time.perf_counter()
                out = run(code)
                times.setdefault((program, name), []).append(time.perf_counter() - start)
                if out != EXPECTED[program]:
                    raise RuntimeError(f"{name} printed {out!r} for {program}, expected {EXPECTED[program]!r}")
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per program and variant")
    args = parser.parse_args(argv)
    print(f"cpu: {cpu_signature()}")
    print("command: " + shlex.join(["python", "bench/sandbox.py", *(sys.argv[1:] if argv is None else argv)]))
    with tempfile.TemporaryDirectory() as tmp:
        old = old_sandbox(Path(tmp))
        print(f"outputs of {len(SAME)} programs (print, exceptions, exit code) identical to old: {same_outputs(old)}")
        runs = variants(old)
        times = measure(args.calls, runs)
    print(f"{'program':>8} {'variant':>8} {'median ms':>10} {'min ms':>8} {'vs old':>7}")
    summary = []
    for program in PROGRAMS:
        base = statistics.median(times[(program, "old")])
        for name in runs:
            t = times[(program, name)]
            ratio = statistics.median(t) / base
            print(f"{program:>8} {name:>8} {1e3 * statistics.median(t):10.1f} {1e3 * min(t):8.1f} {ratio:7.2f}")
            if name != "old":
                summary.append(f"{program}/{name} {ratio:.2f}")
    print(f"summary: median wall time per call vs old ({args.calls} calls each): " + ", ".join(summary))


if __name__ == "__main__":
    main()
