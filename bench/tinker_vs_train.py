"""One tinker-cookbook math_rl step through `hybridflow tinker` vs the same step's work in `hybridflow train`
(issue 53: the service's step must be <= 1.3x the train step), run one after the other in one bench run.

    .venv/bin/python bench/tinker_vs_train.py        # SmolLM2-135M-Instruct, 4 prompts x 8 samples, 16 tokens, LoRA 8

Both sides train a LoRA adapter of the same rank (alpha 32, every linear layer of the decoder: what the service
applies for the cookbook's default lora_config, and `actor.lora.target_modules=all-linear`) on the same batch
(prompts x group size), the same max new tokens, at T=1, one optimizer step per batch, no KL, no validation:
- `service`: `hybridflow tinker` as its own process, and the cookbook's recipe exactly as its README runs it
  (`python -m tinker_cookbook.recipes.math_rl.train env=arithmetic loss_fn=importance_sampling ...`) in the
  cookbook's venv (`--cookbook-python`, default `.venv-cookbook/bin/python`), a second process. Step time:
  the cookbook's `time/total` per iteration in its LOG_PATH/metrics.jsonl (sampling, rewards, forward_backward,
  optim_step, the next sampler's weights save, all over HTTP).
- `train`: `hybridflow train` on data.task=arithmetic, GRPO, 1 worker, trainer.backend=local (one process, as
  the service is one process). Step time: `timing_s/step` in its metrics.jsonl. It runs once per
  `--train-dtypes`: fp32 (actor and rollout) is the service's dtype, the same work; `auto` is train's default
  (bf16 where the matmul probe finds it pays), shown beside it.
The figure per side is the median over the steps after the first (the first includes warm-up). The ratio is
service over train. The prompts differ (the cookbook's arithmetic env vs hybridflow's generated arithmetic
task), so the mean prompt and response lengths each side logged are printed beside the times.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-bench"
COOKBOOK_PYTHON = ROOT / ".venv-cookbook" / "bin" / "python"  # what ./scripts/setup.sh --cookbook makes
SERVICE_STEP = "time/total"
TRAIN_STEP = "timing_s/step"
# (label, cookbook key, hybridflow key): lengths each side logs, to show how far the two workloads differ
LENGTHS = [
    ("prompt tokens", "env/all/ob_tokens_per_turn", "prompt_length/mean"),
    ("response tokens", "env/all/ac_tokens_per_turn", "response_length/mean"),
]


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_times(records: list[dict], key: str) -> list[float]:
    """The per-step seconds under `key`, in logged order; one clear error if no record has it."""
    values = [float(r[key]) for r in records if key in r]
    if not values:
        seen = sorted({k for r in records for k in r})
        raise SystemExit(f"no {key!r} in the metrics (keys: {seen[:40]})")
    return values


def summarize(records: list[dict], key: str) -> dict[str, float]:
    """Median and min step seconds over the steps after the first (all steps if only one), and the step count."""
    times = step_times(records, key)
    timed = times[1:] or times
    return {"steps": len(times), "median_s": statistics.median(timed), "min_s": min(timed), "first_s": times[0]}


def parts(records: list[dict], prefix: str) -> str:
    """Median seconds (steps after the first) of every `prefix`* key but the :count/:mean/:max aggregates."""
    keys = sorted({k for r in records for k in r if k.startswith(prefix) and ":" not in k})
    out = []
    for key in keys:
        values = [float(r[key]) for r in records if key in r]
        out.append(f"{key.removeprefix(prefix)} {statistics.median(values[1:] or values):.2f}")
    return ", ".join(out)


def mean_of(records: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in records if key in r]
    return statistics.fmean(values) if values else None


def start_service(max_tokens: int, state: Path) -> tuple[subprocess.Popen, str, str]:
    """`hybridflow tinker` on the default model; (process, URL, base model name)."""
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "tinker", "--api-key", KEY, "--max-tokens", str(max_tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [*cmd, "--state-dir", str(state)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    line = proc.stdout.readline()
    if not line.startswith("serving Tinker API at "):
        proc.terminate()
        raise SystemExit(f"hybridflow tinker did not start: {line!r}")
    return proc, line.split()[4], line.split("base_model=")[1].strip()


def cookbook_args(args: argparse.Namespace, url: str, model: str, log: Path) -> list[str]:
    return [
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        f"model_name={model}",
        "renderer_name=qwen3_instruct",
        "env=arithmetic",
        "loss_fn=importance_sampling",
        f"group_size={args.group}",
        f"groups_per_batch={args.prompts}",
        f"max_tokens={args.max_tokens}",
        f"learning_rate={args.lr}",
        f"lora_rank={args.lora_rank}",
        f"max_steps={args.steps}",
        f"base_url={url}",
        f"log_path={log}",
        "eval_every=0",
        "save_every=0",
        "behavior_if_log_dir_exists=delete",
    ]


def train_args(args: argparse.Namespace, out: Path, dtype: str = "fp32") -> list[str]:
    return [
        f"actor.engine.param_dtype={dtype}",
        f"rollout.dtype={dtype}",
        "data.task=arithmetic",
        f"data.task_dir={out / 'data'}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_response_length={args.max_tokens}",
        f"data.gen_train_size={max(64, args.prompts * args.steps)}",
        "data.gen_val_size=8",
        f"rollout.n={args.group}",
        "rollout.temperature=1.0",
        "algorithm.adv_estimator=grpo",
        f"actor.lora.rank={args.lora_rank}",
        "actor.lora.alpha=32",
        "actor.lora.target_modules=all-linear",
        f"actor.optim.lr={args.lr}",
        f"actor.ppo_mini_batch_size={args.prompts}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        "trainer.backend=local",
        "trainer.n_workers_per_node=1",
        f"trainer.log_dir={out / 'logs'}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        "trainer.logger=[console,jsonl]",
        "trainer.experiment_name=tinker_vs_train",
    ]


def run_logged(cmd: list[str], env: dict, log: Path, name: str) -> float:
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{name} failed ({proc.returncode}); see {log}")
    return time.perf_counter() - start


def run_service(args: argparse.Namespace, root: Path) -> tuple[list[dict], float]:
    proc, url, model = start_service(max(64, args.max_tokens), root / "tinker-state")
    try:
        log = root / "cookbook"
        env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        wall = run_logged(
            [args.cookbook_python, *cookbook_args(args, url, model, log)], env, root / "cookbook.log", "cookbook"
        )
        return read_metrics(log / "metrics.jsonl"), wall
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_train(args: argparse.Namespace, root: Path, dtype: str) -> tuple[list[dict], float]:
    out = root / f"train-{dtype}"
    out.mkdir()
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hybridflow.cli.train", *train_args(args, out, dtype)]
    wall = run_logged(cmd, env, out / "train.log", "hybridflow train")
    return read_metrics(out / "logs" / "metrics.jsonl"), wall


def report(service: list[dict], train: list[dict], label: str = "train") -> float:
    """Print both sides' step times and lengths; the service / train ratio of the medians."""
    s, t = summarize(service, SERVICE_STEP), summarize(train, TRAIN_STEP)
    print(f"--- service vs {label}")
    print(
        f"{'side':<10} {'steps':>5} {'first s':>8} {'median s':>9} {'min s':>7}  (median/min over steps after the first)"
    )
    for name, row in (("service", s), (label, t)):
        print(f"{name:<10} {row['steps']:5d} {row['first_s']:8.2f} {row['median_s']:9.2f} {row['min_s']:7.2f}")
    print(f"service parts (s): {parts(service, 'time/')}")
    print(f"train parts (s): {parts(train, 'timing_s/')}")
    for what, cookbook_key, train_key in LENGTHS:
        sv, tv = mean_of(service, cookbook_key), mean_of(train, train_key)
        fmt = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"mean {what}: service {fmt(sv)}  {label} {fmt(tv)}")
    ratio = s["median_s"] / t["median_s"]
    print(f"service step / {label} step: {ratio:.2f}x (bar: <= 1.3x) {'PASS' if ratio <= 1.3 else 'FAIL'}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (cookbook groups_per_batch)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (cookbook group_size, rollout.n)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max new tokens per sample")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=4, help="steps per side (the first is not timed)")
    parser.add_argument(
        "--train-dtypes",
        default="fp32,auto",
        help="hybridflow train's actor and rollout dtypes, one run each: fp32 is the service's; auto the default",
    )
    parser.add_argument("--cookbook-python", default=str(COOKBOOK_PYTHON))
    args = parser.parse_args(argv)
    if not Path(args.cookbook_python).exists():
        sys.exit(
            f"no cookbook python at {args.cookbook_python}: run ./scripts/setup.sh --cookbook or pass --cookbook-python"
        )
    from hybridflow.utils.hardware import describe_cpu  # noqa: PLC0415  (keeps --help and the test import light)

    print(describe_cpu(), flush=True)
    print("command: " + shlex.join(["python", "bench/tinker_vs_train.py", *(sys.argv[1:] if argv is None else argv)]))
    print(
        f"batch: {args.prompts} prompts x {args.group} samples, max_tokens {args.max_tokens}, "
        f"LoRA rank {args.lora_rank}, {args.steps} steps per side",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="tinker-vs-train-"))
    service, s_wall = run_service(args, root)
    print(f"service run done in {s_wall:.0f}s (logs: {root})", flush=True)
    trains = {}
    for dtype in args.train_dtypes.split(","):
        trains[dtype], t_wall = run_train(args, root, dtype)
        print(f"train run ({dtype}) done in {t_wall:.0f}s", flush=True)
    for dtype, train in trains.items():
        report(service, train, f"train {dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
