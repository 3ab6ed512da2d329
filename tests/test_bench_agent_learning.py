"""bench/agent_learning.py end to end on a tiny random model: every stage runs and the table has every row.

The stages are real `hybridflow` commands (data, a validation-only run, SFT, export, GRPO with and without
tools on Ray), so this takes minutes: marked slow (CI runs it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_demo_runs_every_stage_and_reports_both_arms(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, str(ROOT / "bench" / "agent_learning.py"), "--tiny", "--harness", f"--out={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for label in (
        "base model, with tools",
        "after the SFT warm-up",
        "after GRPO with tools",
        "after GRPO, openai",
        "after GRPO without",
    ):
        row = next(line for line in text.splitlines() if line.startswith(label))
        acc = float(row[34:].split()[0])
        assert 0.0 <= acc <= 1.0
    rate = next(line for line in text.splitlines() if line.startswith("after GRPO with tools")).split()[-1]
    assert 0.0 <= float(rate) <= 1.0  # the tools arm reports a tool-call rate
    assert re.search(r"harness over HTTP \d+\.\d s \(\d+\.\d\dx\)", text)
    assert re.search(r"total \d+\.\d min", text)
    assert (out / "sft_model" / "config.json").is_file()  # the warm-up was exported and trained from
