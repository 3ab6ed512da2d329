"""The tool-use learning demo (issue 29): an SFT warm-up, then GRPO with the calculator, next to GRPO without it.

Every stage is a `hybridflow` command run as a subprocess, so the demo is exactly what a user would type:
1. `hybridflow data tool_arithmetic` (RL rows and `--sft` transcripts; 3 x 3-digit products);
2. the base model on the held-out rows with tools (`trainer.val_only=true`): does it call the calculator?
3. `hybridflow sft` on the transcripts (the warm-up), then `hybridflow export` to a model directory;
4. GRPO with tools (`rollout.multi_turn.enable=true`) from the warm-up model: its validation before the first
   step is the warm-up model, the last one the trained model;
5. with --harness: the same GRPO run through the OpenAI-compatible endpoint, the agent being the calculator
   harness (`hybridflow/endpoint/examples/calculator.py`, plain `openai`-client code): its accuracy, and its
   median step time against step 4's (the HTTP path's cost, same machine, same invocation);
6. GRPO without tools (single turn, the same rows, steps and sampling) from the base model.
Printed: held-out accuracy and tool-call rate (greedy, the run's validation) before -> after for each arm, and
the wall clock of every stage. Each stage's console log and metrics stay under --out.

    .venv/bin/python bench/agent_learning.py --out /tmp/agent-demo          # SmolLM2-135M-Instruct
    .venv/bin/python bench/agent_learning.py --tiny --out /tmp/agent-tiny   # tiny random model: checks it runs
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

ROOT = Path(__file__).resolve().parent.parent
ACC = "val-core/tool_arithmetic/acc/mean@1"
TOOL_RATE = "val-aux/agent/tool_call_rate"
HARNESS = "hybridflow.endpoint.examples.calculator:run"
"""The calculator agent as plain `openai`-client code (issue 30): the --harness arm trains it."""


def run(stage: str, args: list[str], out: Path, timings: dict[str, float]) -> Path:
    """`hybridflow ARGS` with its console in OUT/STAGE.log; exits with the log's path if it fails."""
    log_path = out / f"{stage}.log"
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "hybridflow.cli.main", *args], env=env, stdout=log, stderr=log)
    timings[stage] = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{stage} failed ({proc.returncode}); see {log_path}")
    print(f"{stage}: {timings[stage]:.0f} s", flush=True)
    return out / stage


def validations(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl that hold a validation."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if ACC in r]


def stage_args(args: argparse.Namespace, out: Path, name: str) -> list[str]:
    """Overrides every train/sft stage shares: where it logs and checkpoints, how chatty it is."""
    return [
        f"trainer.log_dir={out / name}",
        f"trainer.default_local_dir={out / name / 'ckpt'}",
        "trainer.logger=[jsonl]",
    ]


def rl_args(args: argparse.Namespace, data: Path, model: str) -> list[str]:
    """The GRPO run of both arms (only rollout.multi_turn differs)."""
    return [
        f"model.path={model}",
        f"data.train_files=[{data / 'tool_arithmetic_train.parquet'}]",
        f"data.val_files=[{data / 'tool_arithmetic_test.parquet'}]",
        f"data.max_prompt_length={args.prompt_length}",
        f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.batch}",
        f"rollout.n={args.n}",
        f"actor.ppo_mini_batch_size={args.batch}",
        f"actor.optim.lr={args.rl_lr}",
        f"trainer.total_training_steps={args.rl_steps}",
        f"trainer.test_freq={args.rl_steps}",
        *args.overrides,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a new directory for data, models and logs")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (tests): checks every stage runs")
    parser.add_argument("--model", default="default")
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--test-size", type=int, default=64)
    parser.add_argument("--sft-rows", type=int, default=128, help="transcripts of the warm-up (2 SFT rows each)")
    parser.add_argument("--sft-steps", type=int, default=4)
    parser.add_argument("--sft-lr", type=float, default=5e-5)
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--rl-lr", type=float, default=2e-5)
    parser.add_argument("--batch", type=int, default=8, help="prompts per GRPO step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-length", type=int, default=160)
    parser.add_argument("--response-length", type=int, default=64, help="model + tool tokens of a trajectory")
    parser.add_argument("--harness", action="store_true", help=f"also GRPO through the HTTP endpoint with {HARNESS}")
    parser.add_argument("overrides", nargs="*", help="key=value for both GRPO runs")
    args = parser.parse_args()
    if args.tiny:
        tiny(args)
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(os.cpu_count() or 2), flush=True)
    out, timings = args.out.resolve(), {}
    out.mkdir(parents=True, exist_ok=False)
    data = out / "data"
    sizes = [f"--train-size={args.train_size}", f"--test-size={args.test_size}"]
    run("data", ["data", "tool_arithmetic", f"--out={data}", *sizes], out, timings)
    sft_sizes = [f"--train-size={args.sft_rows}", f"--test-size={max(args.test_size // 4, 4)}"]
    run("data_sft", ["data", "tool_arithmetic", "--sft", f"--out={data}", *sft_sizes], out, timings)
    base = rl_args(args, data, args.model)
    run("base", ["train", *base, "rollout.multi_turn.enable=true", "trainer.val_only=true",
                 *stage_args(args, out, "base")], out, timings)  # fmt: skip
    sft = [
        "sft",
        f"model.path={args.model}",
        f"data.train_files=[{data / 'tool_arithmetic_sft_train.parquet'}]",
        f"data.val_files=[{data / 'tool_arithmetic_sft_test.parquet'}]",
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
    run(
        "export", ["export", str(out / "sft" / "ckpt" / f"global_step_{args.sft_steps}"), f"--out={warm}"], out, timings
    )
    tools_run = ["train", *rl_args(args, data, str(warm)), "rollout.multi_turn.enable=true"]
    run("grpo_tools", [*tools_run, *stage_args(args, out, "grpo_tools")], out, timings)
    if args.harness:
        harness = [*tools_run[:-1], f"rollout.agent.function={HARNESS}"]
        run("grpo_harness", [*harness, *stage_args(args, out, "grpo_harness")], out, timings)
    run("grpo_no_tools", ["train", *base, *stage_args(args, out, "grpo_no_tools")], out, timings)
    report(out, timings)


def tiny(args: argparse.Namespace) -> None:
    """Every stage at its smallest on a tiny random model (what tests/test_bench_agent_learning.py runs)."""
    from hybridflow.models import tiny_model_dir  # noqa: PLC0415  (lazy: only --tiny needs it)

    args.model = str(tiny_model_dir("llama"))
    args.train_size, args.test_size, args.sft_rows, args.sft_steps, args.rl_steps = 16, 4, 8, 1, 1
    args.batch, args.n, args.response_length = 2, 2, 16
    args.overrides = [*args.overrides, "actor.ppo_micro_batch_size_per_device=2", "trainer.n_workers_per_node=1"]


def report(out: Path, timings: dict[str, float]) -> None:
    """The before -> after table of every arm, the harness's step time against the loop's, and the wall clock."""
    tools, no_tools = validations(out / "grpo_tools"), validations(out / "grpo_no_tools")
    rows = [("base model, with tools", validations(out / "base")[0]), ("after the SFT warm-up, with tools", tools[0])]
    rows.append(("after GRPO with tools", tools[-1]))
    harness = out / "grpo_harness"
    if harness.is_dir():
        rows.append(("after GRPO, openai-client harness", validations(harness)[-1]))
    rows += [("base model, no tools", no_tools[0]), ("after GRPO without tools", no_tools[-1])]
    print(f"{'':<34}{'held-out acc':>14}{'tool-call rate':>16}")
    for label, r in rows:
        rate = f"{r[TOOL_RATE]:.3f}" if TOOL_RATE in r else "-"
        print(f"{label:<34}{r[ACC]:>14.3f}{rate:>16}")
    if harness.is_dir():
        loop, http = median_step_s(out / "grpo_tools"), median_step_s(harness)
        print(f"median step: in-process loop {loop:.1f} s, harness over HTTP {http:.1f} s ({http / loop:.2f}x)")
    total = sum(timings.values())
    print("wall clock: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {total / 60:.1f} min")


def median_step_s(run_dir: Path) -> float:
    """Median `timing_s/step` of RUN_DIR's training steps."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return statistics.median(r["timing_s/step"] for r in map(json.loads, filter(None, lines)) if "timing_s/step" in r)


if __name__ == "__main__":
    main()
