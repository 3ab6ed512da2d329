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
    multi = {"mt1", "mt", "forced", "forced_nokv", "forced_rounds"}
    assert set(rounds) == {"single"} | multi
    assert all(int(n) > 0 for n in rounds.values())
    # the same forced first turns and seeds: KV reuse changes no sample (the round path samples from other streams)
    assert rounds["forced"] == rounds["forced_nokv"]
    summary = next(line for line in out.splitlines() if line.startswith("summary: "))
    names = "|".join(sorted(multi, key=len, reverse=True))
    ratios = dict(re.findall(rf"({names}) {NUMBER} \(min", summary))
    shares = dict(re.findall(rf"({names}) {NUMBER}", summary.split("env share: ")[1].split(";")[0]))
    rates = dict(re.findall(rf"({names}) {NUMBER}", summary.split("tool-call rate: ")[1]))
    assert set(ratios) == set(shares) == set(rates) == multi
    assert all(float(r) > 0 for r in ratios.values())
    assert all(0.0 <= float(s) <= 1.0 for s in shares.values())
    assert all(float(rates[v]) == 1.0 for v in ("forced", "forced_nokv", "forced_rounds")) and float(rates["mt1"]) <= 1
    for variant in ("forced", "forced_nokv", "forced_rounds"):
        line = re.search(rf"round 0 +{variant}: .*?([\d.]+) turns.*generate ([\d.]+) s.*tools ([\d.]+) s", out)
        assert line and float(line.group(1)) >= 2.0  # the tool result came back and the model went on
        assert float(line.group(2)) > 0 and float(line.group(3)) >= 0
