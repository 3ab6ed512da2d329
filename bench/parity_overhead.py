"""The parity guard's cost on the main job (issue 31), and whether a healthy run trips its default thresholds.

Two `hybridflow train` runs of the main job in one invocation, one after the other: the guard on (the default,
`trainer.parity=error`) for --steps-on steps, then off (`trainer.parity=off`: no fingerprints, no checks, no
rollout log-probs) for --steps-off steps, the same seeds. Printed: the median step time of the first
min(steps) steps of each (the same work: same prompts and samples), their ratio; from the guarded run's own
timers the guard's share of step time (`timing_s/parity` on the controller plus `timing_s/parity_weights` on
the workers, against `timing_s/step`); and the largest log-prob gaps and weight findings it saw.

    .venv/bin/python bench/parity_overhead.py --out /tmp/parity-bench                 # 40 steps on, 12 off
    .venv/bin/python bench/parity_overhead.py --out /tmp/pb --abba --steps-on 12 --steps-off 12   # off, on, on, off

`--abba` runs four runs in the order off, on, on, off (so a drift of the machine over the invocation weighs on both
arms alike) and pools each arm's steps.
    .venv/bin/python bench/parity_overhead.py --out /tmp/parity-bench --steps-on 4 --steps-off 4 trainer.backend=local
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def train(out: Path, steps: int, extra: list[str]) -> list[dict]:
    """Run the main job for `steps` steps under `out`; its step records (metrics.jsonl)."""
    args = [
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.log_dir={out / 'logs'}",
        "trainer.logger=[console,jsonl]",
        *extra,
    ]
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.run([sys.executable, "-m", "hybridflow.cli.train", *args], stdout=log, stderr=log)
    if proc.returncode:
        sys.exit(f"{out.name}: hybridflow train exited {proc.returncode}; see {out.with_suffix('.log')}")
    print(f"{out.name}: {steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 1 and "timing_s/step" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps-on", type=int, default=40)
    parser.add_argument("--steps-off", type=int, default=12)
    parser.add_argument("--abba", action="store_true", help="four runs: off, on, on, off; each arm's steps pooled")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = parser.parse_args()
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(os.cpu_count() or 2), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    off_args = [*args.overrides, "trainer.parity=off"]
    if args.abba:
        runs = [("off_1", False), ("on_1", True), ("on_2", True), ("off_2", False)]
        done = {
            name: train(
                args.out / f"guard_{name}",
                args.steps_on if is_on else args.steps_off,
                args.overrides if is_on else off_args,
            )
            for name, is_on in runs
        }
        arms = [[done["on_1"], done["on_2"]], [done["off_1"], done["off_2"]]]
    else:
        arms = [[train(args.out / "guard_on", args.steps_on, args.overrides)]]
        arms.append([train(args.out / "guard_off", args.steps_off, off_args)])
    n = min(len(rows) for arm in arms for rows in arm)
    step_on, step_off = (statistics.median(r["timing_s/step"] for rows in arm for r in rows[:n]) for arm in arms)
    on = [r for rows in arms[0] for r in rows]
    guard = [r.get("timing_s/parity", 0.0) + r.get("timing_s/parity_weights", 0.0) for r in on]
    share = [g / r["timing_s/step"] for g, r in zip(guard, on, strict=True)]
    print(f"median step, first {n} steps: guard on {step_on:.2f} s, off {step_off:.2f} s ({step_on / step_off:.3f}x)")
    print(
        f"guard's own time over {len(on)} steps: median {statistics.median(guard):.3f} s, "
        f"share of step median {statistics.median(share):.2%}, max {max(share):.2%}"
    )
    for key in ("timing_s/parity", "timing_s/parity_weights"):
        print(f"  {key}: median {statistics.median(r.get(key, 0.0) for r in on):.3f} s")
    worst = {k: max(r.get(k, 0.0) for r in on) for k in ("parity/logprob_gap_mean", "parity/logprob_gap_max")}
    findings = sum(r.get("parity/weight_findings", 0.0) + r.get("parity/token_mismatch_rows", 0.0) for r in on)
    print(f"largest gaps: {worst}; weight findings + token mismatches over the run: {findings:.0f}")


if __name__ == "__main__":
    main()
