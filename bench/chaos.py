"""Chaos: the main job with its workers killed (SIGKILL, from outside) at random times; does every kill recover?

Runs `hybridflow train` twice with the same config, one after the other: once undisturbed (the
reference), then while this script SIGKILLs a random worker process of the run -- a Ray actor process
descended from the run's controller -- at random moments of training. After each kill it waits for the
run to log its recovery and a new step before drawing the next delay, so every kill is a separate
failure. Prints the kills, the recoveries the run logged, the steps redone, the wall-clock overhead
(in total and per recovery) and whether every step's metrics equal the reference's.

    .venv/bin/python bench/chaos.py --tiny --steps 6 --kills 2     # tiny random model: a quick check
    .venv/bin/python bench/chaos.py --steps 20 --kills 3 --save-freq 5   # the main job (SmolLM2-135M)

--tiny swaps SmolLM2 for a tiny random Llama and the arithmetic scorer for a length-based one (the
random model never answers right, and without reward variance its weights would not move, so equal
metrics would prove little). Only the processes of the run this script started are ever killed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from hybridflow.utils.hardware import describe_cpu

ROOT = Path(__file__).resolve().parent.parent
COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm")
LENGTH_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (len(solution_str) % 7) / 7.0\n"
)


def run_args(args: argparse.Namespace, out: Path) -> list[str]:
    """The run's overrides: the main job (or the tiny variant) for --steps steps, checkpoints every --save-freq."""
    common = [
        f"trainer.total_training_steps={args.steps}",
        f"trainer.save_freq={args.save_freq}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.log_dir={out / 'logs'}",
        "trainer.logger=[console,jsonl]",
        f"trainer.max_restarts={args.kills + 1}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.max_ckpt_to_keep=2",
    ]
    if not args.tiny:
        return common
    from hybridflow.models import tiny_model_dir

    reward = out.parent / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
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
        "actor.optim.lr=1e-3",
        f"reward.custom_reward_function.path={reward}",
    ]


def start(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen, Path]:
    out.mkdir(parents=True)
    log = out / "console.log"
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hybridflow.cli.train", *run_args(args, out)]
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT), log


def logged_steps(out: Path) -> list[dict]:
    path = out / "logs" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(None, lines)) if "actor/pg_loss" in r]


def worker_pids(controller: int) -> list[int]:
    """Our Ray actor processes (titled ray::<WorkerClass>) among the controller's descendants."""
    pids = []
    for proc in psutil.Process(controller).children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::") and ("Worker" in title or "Colocated" in title):
            pids.append(proc.pid)
    return pids


def recoveries(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "hybridflow: worker failure:" in line]


def recovery_seconds(log: Path) -> list[float]:
    """The "recovered in X s" of every recovery: restart cost, failure to training again."""
    return [float(m[1]) for m in re.finditer(r"hybridflow: recovered in ([0-9.]+) s", log.read_text())]


def wait_for(cond, proc: subprocess.Popen, timeout_s: float = 1800) -> bool:
    """Poll `cond()` until true; False if the run ended or the time ran out first."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def chaos(args: argparse.Namespace, out: Path, rng: random.Random) -> tuple[float, list[tuple[float, int]], Path]:
    """The run under kills: (wall seconds, [(seconds into the run, pid killed)], its console log)."""
    begin = time.monotonic()
    proc, log = start(args, out)
    kills: list[tuple[float, int]] = []
    while len(kills) < args.kills:
        done = len(logged_steps(out))
        # a new step since the last kill (so its recovery finished), and room left before the end
        if not wait_for(lambda done=done: len(logged_steps(out)) > done and len(recoveries(log)) == len(kills), proc):
            break
        time.sleep(rng.uniform(0, args.max_delay_s))
        pids = worker_pids(proc.pid)
        if proc.poll() is not None or not pids or len(logged_steps(out)) >= args.steps - 1:
            break
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGKILL)
        kills.append((time.monotonic() - begin, pid))
        print(
            f"kill {len(kills)}: SIGKILL worker pid {pid} at {kills[-1][0]:.1f} s "
            f"(after step {len(logged_steps(out))})",
            flush=True,
        )
    proc.wait()
    if proc.returncode != 0:
        sys.exit(f"the chaos run failed (exit {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return time.monotonic() - begin, kills, log


def compare(got: list[dict], ref: list[dict]) -> list[str]:
    """Differences between two runs' per-step metrics (empty: equal)."""
    if [r["step"] for r in got] != [r["step"] for r in ref]:
        return [f"steps logged differ: {[r['step'] for r in got]} vs {[r['step'] for r in ref]}"]
    return [
        f"step {a['step']} {k}: {a[k]} vs {b[k]}"
        for a, b in zip(got, ref)
        for k in COMPARED
        if abs(a[k] - b[k]) > 1e-6 + 1e-5 * abs(b[k])
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random model and a length reward: a quick check")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-freq", type=int, default=5)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--max-delay-s", type=float, default=30.0, help="each kill waits uniform(0, this) after a step")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times and victims")
    parser.add_argument(
        "--out",
        type=Path,
        help="where both runs write (default: a temporary directory, whose checkpoints are deleted at the end)",
    )
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="hybridflow-chaos-"))
    print(f"{describe_cpu()}; runs under {root}", flush=True)

    begin = time.monotonic()
    proc, log = start(args, root / "reference")
    if proc.wait() != 0:
        sys.exit(f"the reference run failed; see {log}:\n{log.read_text()[-3000:]}")
    ref_s = time.monotonic() - begin
    chaos_s, kills, chaos_log = chaos(args, root / "chaos", random.Random(args.seed))

    lines, steps = recoveries(chaos_log), logged_steps(root / "chaos")
    redone = int(steps[-1].get("fault/steps_redone", 0)) if steps else 0
    diffs = compare(steps, logged_steps(root / "reference"))
    print(f"\nkills: {len(kills)}   recoveries logged: {len(lines)}   steps redone: {redone}")
    for line in lines:
        print("  " + line.split("hybridflow: ", 1)[1])
    overhead = chaos_s - ref_s
    per = f", {overhead / len(lines):.1f} s per recovery" if lines else ""
    print(f"wall clock: reference {ref_s:.1f} s, with kills {chaos_s:.1f} s: overhead {overhead:.1f} s{per}")
    restart_s = recovery_seconds(chaos_log)
    if restart_s:
        step_s = statistics.median(r["timing_s/step"] for r in logged_steps(root / "reference"))
        print(
            f"restart cost (failure to training again): {', '.join(f'{x:.1f}' for x in restart_s)} s; "
            f"the rest of the overhead is {redone} redone steps (median step {step_s:.1f} s) and their warm-up"
        )
    print("final metrics equal the reference's: " + ("yes" if not diffs else "NO\n  " + "\n  ".join(diffs[:10])))
    if args.out is None:  # the checkpoints are large (SmolLM2 with optimizer: ~1.6 GB each); logs stay
        for run in ("reference", "chaos"):
            shutil.rmtree(root / run / "ckpt", ignore_errors=True)
    sys.exit(0 if not diffs and len(lines) == len(kills) else 1)


if __name__ == "__main__":
    main()
