"""bench/agent_loop.py through its CLI on the tiny model, one round: every figure is printed and sane
(no timing is asserted: the numbers of a tiny random model on a shared CPU mean nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"(\d+(?:\.\d+)?)"


def test_tiny_run_prints_ratios_shares_and_tool_use():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "bench/agent_loop.py", "--tiny", "--rounds", "1", "--threads", "1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("cpu: ") and "command: python bench/agent_loop.py --tiny --rounds 1" in out
    rounds = dict(re.findall(r"round 0 +(\w+): +[\d.]+ s, +(\d+) tokens", out))
    assert set(rounds) == {"single", "mt1", "mt", "forced"}
    assert rounds["mt1"] == rounds["single"] != "0"  # one turn, same seed: the very same samples
    summary = next(line for line in out.splitlines() if line.startswith("summary: "))
    ratios = dict(re.findall(rf"(mt1|mt|forced) {NUMBER} \(min", summary))
    shares = dict(re.findall(rf"(mt1|mt|forced) {NUMBER}", summary.split("env share: ")[1].split(";")[0]))
    rates = dict(re.findall(rf"(mt1|mt|forced) {NUMBER}", summary.split("tool-call rate: ")[1]))
    assert set(ratios) == set(shares) == set(rates) == {"mt1", "mt", "forced"}
    assert all(float(r) > 0 for r in ratios.values())
    assert all(0.0 <= float(s) <= 1.0 for s in shares.values())
    assert float(rates["forced"]) == 1.0 and float(rates["mt1"]) <= 1.0
    forced = re.search(r"round 0 forced: .*?([\d.]+) turns", out)
    assert forced and float(forced.group(1)) >= 2.0  # the tool result came back and the model went on
