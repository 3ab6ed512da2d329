"""Measure the log-prob parity of a healthy run: `hybridflow train` with trainer.parity=warn for a few steps, then
the largest parity/logprob_* value over its steps (docs/parity.md lists what it measured).

    PYTHONPATH=. python scripts/measure_parity.py OUT_DIR key=value ...

Prints one JSON line: the overrides, the steps, and per metric the largest value over the steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

METRICS = ("parity/logprob_gap_mean", "parity/logprob_gap_max", "parity/logprob_frac_beyond")


def main(out: Path, overrides: list[str]) -> dict:
    """Run the CLI into `out` with `overrides` (after small-run defaults), return the measurement."""
    args = [
        f"data.task_dir={out / 'data'}",
        "data.gen_train_size=64",
        "data.gen_val_size=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.parity=warn",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.log_dir={out / 'logs'}",
        "trainer.logger=[jsonl]",
        *overrides,
    ]
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.train", *args], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "parity/logprob_gap_mean" in r]
    worst = {m: max(r[m] for r in steps) for m in METRICS}
    return {"overrides": overrides, "steps": len(steps), "wall_s": round(time.perf_counter() - start), **worst}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2:])))
