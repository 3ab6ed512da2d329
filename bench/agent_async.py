"""The multi-turn agent trained sync vs one step off policy (with and without partial rollout): step time and
held-out accuracy side by side, at the same batch, in one invocation.

Runs `hybridflow train` on the tool task (`tool_arithmetic`, the calculator offered, rollout.multi_turn) once per
mode, one after the other, with the same data, batch, rollout.n and steps:
- sync: colocated, 1 worker with all --threads (generation and training take turns in it);
- one_step_off: split 1 + 1 (the agent loop on the rollout's own worker), batch k+1 generated while batch k trains;
- partial: one_step_off with trainer.partial_rollout=true (an update lands in the trajectories in flight).
Printed per mode: median step time (the first step excluded: it also warms up), the agent loop's median wall time
on its worker, the weight transfer's median seconds, the share of rows holding two policy versions, and held-out
greedy accuracy (val-core/tool_arithmetic/acc/mean@1) before the first step and after the last. Ratios are against
sync in the same invocation; on a shared 2-core machine only those ratios mean anything.

    .venv/bin/python bench/agent_async.py --tiny --steps 3               # tiny random model: every mode runs
    .venv/bin/python bench/agent_async.py --model /path/to/sft_export    # a policy that already calls the tool
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
    "partial": [
        "trainer.mode=one_step_off",
        "trainer.placement=split",
        "trainer.n_workers_per_node=2",
        "trainer.partial_rollout=true",
    ],
}
ACC = "val-core/tool_arithmetic/acc/mean@1"


def run_args(args: argparse.Namespace, out: Path, mode: str) -> list[str]:
    """One mode's overrides: the tool task for --steps steps, validated before the first and after the last."""
    threads = args.threads if mode == "sync" else max(1, args.threads // 2)
    common = [
        *MODES[mode],
        "data.task=tool_arithmetic",
        f"data.task_dir={out.parent / 'data'}",
        "data.max_prompt_length=256",
        f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.batch}",
        f"data.gen_train_size={max(64, args.batch * args.steps)}",
        f"data.gen_val_size={args.val_rows}",
        f"rollout.n={args.n}",
        "rollout.multi_turn.enable=true",
        "rollout.calculate_log_probs=true",
        "algorithm.rollout_is_threshold=2.0",
        "algorithm.rollout_is=true",
        f"actor.ppo_mini_batch_size={args.batch}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.steps}",
        "trainer.val_before_train=true",
        f"trainer.cpus_per_worker={threads}",
        f"trainer.log_dir={out / 'logs'}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.logger=[console,jsonl]",
        "trainer.experiment_name=" + mode,
    ]
    if args.model:
        return [*common, f"model.path={args.model}"]
    if not args.tiny:
        return common
    from hybridflow.models import tiny_model_dir

    return [*common, f"model.path={tiny_model_dir('llama')}", "actor.ppo_micro_batch_size_per_device=2"]


def run_mode(args: argparse.Namespace, root: Path, mode: str) -> list[dict]:
    """Train in `mode`; every metric record it logged."""
    out = root / mode
    out.mkdir(parents=True)
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hybridflow.cli.train", *run_args(args, out, mode)]
    with (out / "console.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{mode} failed ({proc.returncode}); see {out / 'console.log'}")
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def summarize(records: list[dict]) -> dict[str, float]:
    """Median step, agent-loop and transfer seconds (steps after the first), partial rows, accuracy before/after."""
    steps = [r for r in records if "actor/pg_loss" in r]
    timed = steps[1:] or steps
    vals = [r[ACC] for r in records if ACC in r]

    def median(key: str) -> float:
        values = [r[key] for r in timed if key in r]
        return statistics.median(values) if values else 0.0

    return {
        "step_s": median("timing_s/step"),
        "loop_s": median("agent/loop_time_s"),
        "transfer_s": median("timing_s/weight_transfer"),
        "partial_rows": statistics.mean(r.get("async/partial_rows", 0.0) for r in steps),
        "acc_before": vals[0] if vals else float("nan"),
        "acc_after": vals[-1] if vals else float("nan"),
        "steps": float(len(steps)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random model: a quick check that every mode runs")
    parser.add_argument("--model", default=None, help="model.path (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="data.train_batch_size (prompts per step)")
    parser.add_argument("--n", type=int, default=4, help="rollout.n")
    parser.add_argument("--response-length", type=int, default=96, help="data.max_response_length")
    parser.add_argument("--val-rows", type=int, default=32, help="held-out rows (data.gen_val_size)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads of the whole run")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = parser.parse_args()
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(args.threads), flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-agent-async-") as tmp:
        for mode in args.modes.split(","):
            results[mode] = summarize(run_mode(args, Path(tmp), mode))
            print(f"{mode}: done, {int(results[mode]['steps'])} steps", flush=True)
    base = results.get("sync", next(iter(results.values())))
    print(
        f"{'mode':<14}{'step s':>9}{'x sync':>8}{'loop s':>9}{'transfer s':>12}{'partial rows':>14}"
        f"{'acc before':>12}{'acc after':>11}"
    )
    for mode, s in results.items():
        print(
            f"{mode:<14}{s['step_s']:>9.2f}{base['step_s'] / s['step_s']:>8.2f}{s['loop_s']:>9.2f}"
            f"{s['transfer_s']:>12.3f}{s['partial_rows']:>14.2f}{s['acc_before']:>12.3f}{s['acc_after']:>11.3f}"
        )


if __name__ == "__main__":
    main()
