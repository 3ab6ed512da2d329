"""bench/tinker_service.py through its CLI on the tiny model, one round: both sides sample every row and the ratio
is printed (no timing is asserted: the numbers of a tiny random model on a shared CPU mean nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_run_prints_both_sides_and_the_ratio():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "bench/tinker_service.py", "--tiny", "--rounds", "1", "--rows", "3", "--max-tokens", "8"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("cpu: ") and "command: python bench/tinker_service.py --tiny" in out
    (row,) = re.findall(r"^ +0 +(\d+) +([\d.]+) +(\d+) +([\d.]+) +([\d.]+)$", out, flags=re.M)
    native_tokens, _, service_tokens, _, ratio = row
    # 3 rows of 1 to 8 tokens each side: every row was sampled through the service
    assert 3 <= int(native_tokens) <= 24 and 3 <= int(service_tokens) <= 24 and float(ratio) > 0
    assert re.search(r"service / native tokens/s: median [\d.]+, min [\d.]+", out)
