"""What GRPO adds to tool use (issue 55): a warm-up that teaches part of the skill, then GRPO on the whole task.

The task is `tool_sum_products` (`a * b + c * d`, 3-digit factors, the calculator offered); the warm-up is SFT
on `tool_arithmetic` transcripts only (one calculator call on one product `a * b`, then the result as the
answer), kept short (--sft-steps), so the warm-up model has seen the call format but never a sum of
products, and calls the calculator on the whole expression only some of the time. GRPO on the sum-of-products
rows then rewards the trajectories that do. Every stage is a `hybridflow` command run as a subprocess:
1. `hybridflow data tool_sum_products` (RL rows) and `hybridflow data tool_arithmetic --sft` (warm-up transcripts);
2. the base model on the held-out sum-of-products rows with tools (`trainer.val_only=true`);
3. `hybridflow sft` on the product transcripts (the warm-up), then `hybridflow export`;
4. GRPO with tools (`rollout.multi_turn.enable=true`) from the warm-up model on the sum-of-products rows: its
   validation before the first step is the warm-up model, the last one the trained model.
Every stage runs 1 Ray worker (--workers) and GRPO checkpoints every step: on a shared host a worker killed for
memory then costs one step, not the run. Printed: held-out accuracy and tool-call rate (greedy, the run's validation) of base, warm-up and GRPO, the
gain of GRPO over the warm-up in points, the training reward (T=1 samples) of every GRPO step, and the wall
clock of every stage. Each stage's console log and metrics stay under --out.

    .venv/bin/python bench/agent_rl_gain.py --out /tmp/agent-gain          # SmolLM2-135M-Instruct
    .venv/bin/python bench/agent_rl_gain.py --tiny --out /tmp/agent-tiny   # tiny random model: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from agent_learning import TOOL_RATE, median_step_s, run

TASK = "tool_sum_products"
WARMUP_TASK = "tool_arithmetic"
ACC = f"val-core/{TASK}/acc/mean@1"
SCORE = "critic/score/mean"


def records(run_dir: Path) -> list[dict]:
    """RUN_DIR/metrics.jsonl as dicts."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def stage_args(args: argparse.Namespace, out: Path, name: str) -> list[str]:
    """Overrides every stage shares: where it logs and checkpoints, and its worker count (one worker holds one
    copy of the model and its optimizer state: on a shared 2-core host, two were killed for memory)."""
    return [
        f"trainer.log_dir={out / name}",
        f"trainer.default_local_dir={out / name / 'ckpt'}",
        "trainer.logger=[jsonl]",
        f"trainer.n_workers_per_node={args.workers}",
    ]


def rl_args(args: argparse.Namespace, data: Path, model: str) -> list[str]:
    """The base validation's and the GRPO run's overrides (the tools loop on, the sum-of-products rows)."""
    return [
        f"model.path={model}",
        f"data.train_files=[{data / f'{TASK}_train.parquet'}]",
        f"data.val_files=[{data / f'{TASK}_test.parquet'}]",
        f"data.max_prompt_length={args.prompt_length}",
        f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.batch}",
        f"rollout.n={args.n}",
        "rollout.multi_turn.enable=true",
        f"actor.ppo_mini_batch_size={args.batch}",
        f"actor.optim.lr={args.rl_lr}",
        f"trainer.total_training_steps={args.rl_steps}",
        f"trainer.test_freq={args.test_freq or args.rl_steps}",
        "trainer.save_freq=1",  # a worker lost (killed for memory) costs the step it was on, not the whole run
        *args.overrides,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a new directory for data, models and logs")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (tests): checks every stage runs")
    parser.add_argument("--model", default="default")
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--test-size", type=int, default=64)
    parser.add_argument("--sft-rows", type=int, default=128, help="product transcripts of the warm-up (2 rows each)")
    parser.add_argument("--sft-steps", type=int, default=2, help="warm-up steps of 16 rows (4 learns it all)")
    parser.add_argument("--sft-lr", type=float, default=5e-5)
    parser.add_argument("--rl-steps", type=int, default=4)
    parser.add_argument("--rl-lr", type=float, default=3e-5)
    parser.add_argument("--test-freq", type=int, default=0, help="validate every this many GRPO steps (0: last)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per GRPO step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--workers", type=int, default=1, help="Ray workers of every stage")
    parser.add_argument("--prompt-length", type=int, default=160)
    parser.add_argument("--response-length", type=int, default=96, help="model + tool tokens of a trajectory")
    parser.add_argument("overrides", nargs="*", help="key=value for the base validation and the GRPO run")
    args = parser.parse_args()
    if args.tiny:
        tiny(args)
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(os.cpu_count() or 2), flush=True)
    out, timings = args.out.resolve(), {}
    out.mkdir(parents=True, exist_ok=False)
    data = out / "data"
    run("data", ["data", TASK, f"--out={data}", f"--train-size={args.train_size}", f"--test-size={args.test_size}"],
        out, timings)  # fmt: skip
    sft_sizes = [f"--train-size={args.sft_rows}", f"--test-size={max(args.test_size // 4, 4)}"]
    run("data_sft", ["data", WARMUP_TASK, "--sft", f"--out={data}", *sft_sizes], out, timings)
    base = rl_args(args, data, args.model)
    run("base", ["train", *base, "trainer.val_only=true", *stage_args(args, out, "base")], out, timings)
    sft = [
        "sft",
        f"model.path={args.model}",
        f"data.train_files=[{data / f'{WARMUP_TASK}_sft_train.parquet'}]",
        f"data.val_files=[{data / f'{WARMUP_TASK}_sft_test.parquet'}]",
        "data.messages_key=messages",
        f"data.max_length={args.prompt_length + args.response_length}",
        "data.train_batch_size=16",
        f"optim.lr={args.sft_lr}",
        f"trainer.total_training_steps={args.sft_steps}",
        f"trainer.save_freq={args.sft_steps}",
        f"trainer.test_freq={args.sft_steps}",
        *stage_args(args, out, "sft"),
    ]
    run("sft", sft, out, timings)
    warm = out / "sft_model"
    ckpt = out / "sft" / "ckpt" / f"global_step_{args.sft_steps}"
    run("export", ["export", str(ckpt), f"--out={warm}"], out, timings)
    run("grpo", ["train", *rl_args(args, data, str(warm)), *stage_args(args, out, "grpo")], out, timings)
    report(out, timings)


def tiny(args: argparse.Namespace) -> None:
    """Every stage at its smallest on a tiny random model (what tests/test_bench_agent_rl_gain.py runs)."""
    from hybridflow.models import tiny_model_dir  # noqa: PLC0415  (lazy: only --tiny needs it)

    args.model = str(tiny_model_dir("llama"))
    args.train_size, args.test_size, args.sft_rows, args.sft_steps, args.rl_steps = 16, 4, 8, 1, 1
    args.batch, args.n, args.response_length = 2, 2, 16
    args.overrides = [*args.overrides, "actor.ppo_micro_batch_size_per_device=2"]


def report(out: Path, timings: dict[str, float]) -> None:
    """Held-out accuracy of base, warm-up and GRPO, the gain in points, the training reward per step, wall clock."""
    grpo = records(out / "grpo")
    vals = [r for r in grpo if ACC in r]
    base = next(r for r in records(out / "base") if ACC in r)
    rows = [("base model", base), ("after the SFT warm-up (products only)", vals[0])]
    rows += [(f"after GRPO step {r['step']}", r) for r in vals[1:]] if len(vals) > 2 else [("after GRPO", vals[-1])]
    print(f"{'':<40}{'held-out acc':>14}{'tool-call rate':>16}")
    for label, r in rows:
        print(f"{label:<40}{r[ACC]:>14.3f}{r.get(TOOL_RATE, float('nan')):>16.3f}")
    print(f"GRPO over the warm-up: {100 * (vals[-1][ACC] - vals[0][ACC]):+.1f} points")
    scores = [f"{r[SCORE]:.3f}" for r in grpo if SCORE in r]
    print(
        f"training reward per GRPO step (T=1 samples): {' / '.join(scores)}; median step {median_step_s(out / 'grpo'):.0f} s"
    )
    total = sum(timings.values())
    print("wall clock: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {total / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
