"""On-policy distillation against GRPO from the same student, on the same task and rollout budget (issue 54's demo).

Every stage is a `hybridflow` command run as a subprocess, so the demo is what a user would type:
1. the teacher: `--teacher DIR` (an exported policy), or the main job's GRPO trained here for --teacher-steps
   steps (`hybridflow train`, the main job's defaults) and exported (`hybridflow export`);
2. the teacher's held-out accuracy (`trainer.val_only=true`);
3. distillation: the student (--student, the bundled SmolLM2-135M-Instruct by default) trained with the teacher's
   per-token advantage -reverse KL alone (`distillation.enabled=true distillation.use_task_rewards=false`);
4. GRPO: the same student, the same prompts, batch, samples per prompt, steps and validation schedule, trained on
   the rule reward.
Printed: held-out accuracy at every validation of both arms (step 0 is the student before training), the steps
each arm needs to reach 90% of the teacher's accuracy (or "not reached"), the distillation arm's teacher KL per
step, and the wall clock of every stage. Each stage's console log and metrics stay under --out.

    .venv/bin/python bench/distill_vs_grpo.py --out /tmp/distill-demo                      # the issue's size
    .venv/bin/python bench/distill_vs_grpo.py --out /tmp/distill-demo --teacher main_policy
    .venv/bin/python bench/distill_vs_grpo.py --out /tmp/distill-small --teacher-steps 8 --steps 6 --val-every 2 \\
        --batch 4 --n 4 --val-size 32
    .venv/bin/python bench/distill_vs_grpo.py --tiny --out /tmp/distill-tiny               # tiny models: runs at all
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from agent_learning import run  # the same stage runner: `hybridflow ARGS`, its console in OUT/STAGE.log

ACC = "val-core/arithmetic/acc/mean@1"
KL = "distillation/teacher_kl"


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def task_args(args: argparse.Namespace, out: Path, name: str) -> list[str]:
    """What every run shares: the generated task (one data dir: the same prompts), lengths, batch, logging."""
    return [
        f"data.task_dir={out / 'data'}",
        f"data.gen_val_size={args.val_size}",
        f"data.train_batch_size={args.batch}",
        f"data.max_response_length={args.response_length}",
        f"rollout.n={args.n}",
        f"actor.ppo_mini_batch_size={args.batch // 2 if args.batch > 1 else 1}",
        f"trainer.log_dir={out / name}",
        f"trainer.default_local_dir={out / name / 'ckpt'}",
        "trainer.logger=[jsonl]",
        *args.extra,
    ]


def arm_args(args: argparse.Namespace, out: Path, name: str) -> list[str]:
    """One arm: the student trained for --steps steps, validated every --val-every steps and before the first."""
    return [
        "train",
        f"model.path={args.student}",
        *task_args(args, out, name),
        f"actor.optim.lr={args.lr}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.val_every}",
        "trainer.val_before_train=true",
        "trainer.save_freq=-1",
    ]


def make_teacher(args: argparse.Namespace, out: Path, timings: dict[str, float]) -> str:
    """The teacher directory: --teacher, or the main job's GRPO trained here and exported."""
    if args.teacher:
        return args.teacher
    steps = args.teacher_steps
    run(
        "teacher_train",
        [
            "train",
            f"model.path={args.student}",
            *task_args(args, out, "teacher_train"),
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={steps}",
            "trainer.val_before_train=false",
            f"trainer.save_freq={steps}",
        ],
        out,
        timings,
    )
    teacher = out / "teacher"
    run(
        "teacher_export",
        ["export", str(out / "teacher_train" / "ckpt" / f"global_step_{steps}"), "--out", str(teacher)],
        out,
        timings,
    )
    return str(teacher)


def steps_to(curve: list[tuple[int, float]], target: float) -> str:
    """The first validation step whose accuracy reaches `target`, or "not reached"."""
    return next((str(step) for step, acc in curve if acc >= target), "not reached")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--student", default="default", help="the student's model directory (default: bundled SmolLM2)")
    p.add_argument("--teacher", help="an exported teacher; default: train the main job here and export it")
    p.add_argument("--teacher-steps", type=int, default=40, help="steps of the main job that trains the teacher")
    p.add_argument("--steps", type=int, default=40, help="training steps of each arm")
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="prompts per step (the main job's)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the main job's)")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--val-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5, help="actor lr of both arms (the main job's)")
    p.add_argument("--tiny", action="store_true", help="tiny random student: checks the plumbing, measures nothing")
    p.add_argument("extra", nargs="*", help="key=value overrides for every run")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from hybridflow.models import tiny_model_dir  # noqa: PLC0415  (lazy: the plain path needs no torch here)

        args.student = str(tiny_model_dir("llama"))
    from hybridflow.utils.hardware import describe_cpu  # noqa: PLC0415  (lazy: torch)

    print(describe_cpu(os.cpu_count() or 2), flush=True)
    timings: dict[str, float] = {}
    teacher = make_teacher(args, args.out, timings)
    run(
        "teacher_val",
        ["train", f"model.path={teacher}", *task_args(args, args.out, "teacher_val"), "trainer.val_only=true"],
        args.out,
        timings,
    )
    teacher_acc = next(r[ACC] for r in records(args.out / "teacher_val") if ACC in r)
    distill = [
        "distillation.enabled=true",
        f"distillation.teacher.path={teacher}",
        "distillation.use_task_rewards=false",
    ]
    run("distill", [*arm_args(args, args.out, "distill"), *distill], args.out, timings)
    run("grpo", arm_args(args, args.out, "grpo"), args.out, timings)

    print(f"\nteacher {teacher}: held-out accuracy {teacher_acc:.3f}; 90% of it: {0.9 * teacher_acc:.3f}")
    print(f"{'step':>6}{'distillation':>14}{'GRPO':>10}")
    curves = {}
    for arm in ("distill", "grpo"):
        curves[arm] = [(r["step"], r[ACC]) for r in records(args.out / arm) if ACC in r]
    steps = sorted({s for curve in curves.values() for s, _ in curve})
    for step in steps:
        cells = ["-" if (c := dict(curves[arm]).get(step)) is None else f"{c:.3f}" for arm in ("distill", "grpo")]
        print(f"{step:>6}{cells[0]:>14}{cells[1]:>10}")
    if teacher_acc == 0:
        print("the teacher scores 0: 'steps to 90%' below compares nothing")
    for arm, label in (("distill", "distillation"), ("grpo", "GRPO")):
        print(f"steps to 90% of the teacher, {label}: {steps_to(curves[arm], 0.9 * teacher_acc)}")
    kl = [round(r[KL], 3) for r in records(args.out / "distill") if KL in r]
    print(f"distillation/teacher_kl per step: {kl}")
    total = sum(timings.values())
    print("wall clock: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {total / 60:.1f} min")


if __name__ == "__main__":
    main()
