"""bench/sandbox.py through its CLI, one call per program and variant: the header, the check that the new sandbox
prints what the old one did, and a ratio per variant (no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.sandbox_required import require_sandbox

ROOT = Path(__file__).resolve().parents[1]


require_sandbox()


def test_one_call_each_prints_identical_outputs_and_ratios():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "bench/sandbox.py", "--calls", "1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("cpu: ") and "command: python bench/sandbox.py --calls 1" in out
    assert "identical to old: True" in out
    summary = next(line for line in out.splitlines() if line.startswith("summary: "))
    ratios = dict(re.findall(r"(\w+/\w+) (\d+\.\d+)", summary))
    assert {"print/rlimit", "loop/rlimit"} <= set(ratios) and all(float(r) > 0 for r in ratios.values())
