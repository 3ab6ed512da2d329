"""bench/agent_rl_gain.py end to end on a tiny random model: every stage runs and the report has every line.

The stages are real `hybridflow` commands (data, a validation-only run, SFT, export, GRPO with tools on Ray), so
this takes over a minute: marked slow.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_demo_runs_every_stage_and_reports_the_gain(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, str(ROOT / "bench" / "agent_rl_gain.py"), "--tiny", f"--out={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    accs = {}
    for label in ("base model", "after the SFT warm-up", "after GRPO"):
        row = next(line for line in lines if line.startswith(label))
        acc, rate = (float(x) for x in row[40:].split())
        assert 0.0 <= acc <= 1.0 and 0.0 <= rate <= 1.0
        accs[label] = acc
    gain = re.search(r"GRPO over the warm-up: ([+-]\d+\.\d) points", proc.stdout)
    assert gain and float(gain.group(1)) == pytest.approx(
        100 * (accs["after GRPO"] - accs["after the SFT warm-up"]), abs=0.06
    )
    assert re.search(r"training reward per GRPO step \(T=1 samples\): \d\.\d{3}; median step \d+ s", proc.stdout)
    assert re.search(r"total \d+\.\d min", proc.stdout)
    assert (out / "sft_model" / "config.json").is_file() and (out / "data" / "tool_sum_products_test.parquet").is_file()
