"""Sync vs one-step-off vs async training: step time, generated tokens/s and reward per step, in one run.

Runs `hybridflow train` once per mode with the same config, one after the other, and compares them:
- sync: colocated, 1 worker with --threads threads (generation and training take turns in it);
- one_step_off: split 1 + 1 (the rollout on its own worker), batch k+1 generated while batch k trains;
- async: split 1 + 1 with trainer.max_staleness=--staleness.
Printed per mode: median step time (first step excluded: it also warms up), generated response tokens
per second of wall time, the weight transfer's median seconds, and the mean reward of every step (the
same number of samples in every mode, so off-policy learning can be compared step for step). Ratios are
against sync in the same invocation; on a shared 2-core machine only those ratios mean anything.

    .venv/bin/python bench/async.py --tiny --steps 2      # tiny random model: checks that every mode runs
    .venv/bin/python bench/async.py --steps 20            # the main job's task on SmolLM2-135M
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "sync": ["trainer.mode=sync", "trainer.placement=colocate", "trainer.n_workers_per_node=1"],
    "one_step_off": ["trainer.mode=one_step_off", "trainer.placement=split", "trainer.n_workers_per_node=2"],
    "async": ["trainer.mode=async", "trainer.placement=split", "trainer.n_workers_per_node=2"],
}


def run_args(args: argparse.Namespace, out: Path, mode: str) -> list[str]:
    """One mode's overrides: the main job (or a tiny variant) for --steps steps, no validation."""
    threads = args.threads if mode == "sync" else max(1, args.threads // 2)
    common = [
        *MODES[mode],
        f"trainer.total_training_steps={args.steps}",
        f"trainer.cpus_per_worker={threads}",
        f"trainer.log_dir={out / 'logs'}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.logger=[console,jsonl]",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "rollout.calculate_log_probs=true",
        f"algorithm.rollout_is_threshold={args.is_threshold}",
        "algorithm.rollout_is=true",
        "trainer.experiment_name=" + mode,
    ]
    if mode == "async":
        common.append(f"trainer.max_staleness={args.staleness}")
    if not args.tiny:
        return common
    from hybridflow.models import tiny_model_dir

    return common + [
        f"model.path={tiny_model_dir('llama')}",
        f"data.task_dir={out.parent / 'data'}",
        "data.gen_train_size=64",
        "data.gen_val_size=4",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_device=2",
    ]


def run_mode(args: argparse.Namespace, root: Path, mode: str) -> list[dict]:
    """Train in `mode`; its per-step metric records."""
    out = root / mode
    out.mkdir(parents=True)
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hybridflow.cli.train", *run_args(args, out, mode)]
    with (out / "console.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{mode} failed ({proc.returncode}); see {out / 'console.log'}")
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "actor/pg_loss" in r]


def summarize(records: list[dict]) -> dict[str, float]:
    """Median step time (steps after the first), generated tokens per wall second, transfer time."""
    timed = records[1:] or records
    step = statistics.median(r["timing_s/step"] for r in timed)
    # response tokens of a step = (tokens / s of the gen phase) x (its seconds); in the off-policy modes the
    # gen phase is only the wait for a batch generated ahead, so only this product means anything
    tokens = statistics.median(r.get("perf/gen_tokens_per_s", 0.0) * r["timing_s/gen"] for r in timed)
    transfer = [r["timing_s/weight_transfer"] for r in timed if "timing_s/weight_transfer" in r]
    return {
        "step_s": step,
        "gen_tokens_per_s": tokens / step,
        "transfer_s": statistics.median(transfer) if transfer else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random model: a quick check that every mode runs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads of the whole run")
    parser.add_argument("--staleness", type=int, default=2, help="trainer.max_staleness of the async mode")
    parser.add_argument("--is-threshold", type=float, default=2.0, help="algorithm.rollout_is_threshold")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = parser.parse_args()
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(args.threads), flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for mode in args.modes.split(","):
            results[mode] = (summarize(records := run_mode(args, Path(tmp), mode)), records)
            print(f"{mode}: done, {len(records)} steps", flush=True)
    base = results.get("sync", next(iter(results.values())))[0]
    print(f"{'mode':<14}{'step s':>9}{'x sync':>8}{'gen tok/s':>11}{'x sync':>8}{'transfer s':>12}")
    for mode, (s, _) in results.items():
        print(
            f"{mode:<14}{s['step_s']:>9.2f}{base['step_s'] / s['step_s']:>8.2f}{s['gen_tokens_per_s']:>11.1f}"
            f"{s['gen_tokens_per_s'] / base['gen_tokens_per_s']:>8.2f}{s['transfer_s']:>12.3f}"
        )
    print("mean reward per step (critic/score/mean):")
    for mode, (_, records) in results.items():
        print(f"  {mode:<14}" + " ".join(f"{r['critic/score/mean']:.3f}" for r in records))


if __name__ == "__main__":
    main()
