"""hybridflow vs TRL's GRPOTrainer on the same CPU work, run one after the other.

Same model (SmolLM2-135M-Instruct), same arithmetic prompts in the same order (no
shuffle), same batches (P prompts x 4 samples), same prompt/response limits (64/32),
same learning rate and number of steps, GRPO without KL, temperature 1, both on 2
CPU threads in total (TRL: one process with 2 threads; hybridflow in up to three layouts: one
worker with 2 threads, "hf 1x2", two workers with 1 thread each, "hf 2x1", and optionally
the one worker inside the controller's process, "hf local": trainer.backend=local). Prints
median step time, generated tokens/s, peak memory (RSS summed over each run's process
tree) and the reward curve of each.

    ./bench/setup_trl_env.sh                       # once: the benchmark-only TRL env
    .venv/bin/python bench/vs_trl.py --steps 8     # both sizes, three layouts: ~15 min on 2 cores
    .venv/bin/python bench/vs_trl.py --lora-rank 16   # both sides train LoRA adapters (peft) instead
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def tree_rss_mb(proc: psutil.Process) -> float:
    """Resident memory of a process and all its descendants, in MiB (0 for a tree that ended while listed)."""
    total = 0
    try:
        tree = [proc, *proc.children(recursive=True)]
    except psutil.Error:  # a child exited between listing and inspecting it
        return 0.0
    for p in tree:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def run_measured(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    """Run `cmd`, sampling its process tree's RSS every 0.2 s; returns (peak MiB, output tail)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, done = [0.0], threading.Event()

    def poll() -> None:
        ps = psutil.Process(proc.pid)
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_mb(ps))
            time.sleep(0.2)

    threading.Thread(target=poll, daemon=True).start()
    out, _ = proc.communicate()
    done.set()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}):\n{out[-4000:]}")
    return peak[0], out[-2000:]


def trl_side(args, model_dir: str, parquet: str, prompts: int, work: Path) -> dict:
    out = work / f"trl_{prompts}.json"
    cmd = [
        str(ROOT / ".venv-trl/bin/python"),
        str(ROOT / "bench/trl_side.py"),
        "--model-dir",
        model_dir,
        "--train-parquet",
        parquet,
        "--prompts-per-step",
        str(prompts),
        "--num-generations",
        "4",
        "--max-prompt-length",
        "64",
        "--max-completion-length",
        "32",
        "--lr",
        str(args.lr),
        "--steps",
        str(args.steps),
        "--threads",
        "2",
        "--seed",
        "0",
        "--out",
        str(out),
        "--lora-rank",
        str(args.lora_rank),
        "--lora-alpha",
        str(args.lora_alpha),
        "--precision",
        args.trl_precision,
    ]
    peak, _ = run_measured(cmd, dict(os.environ), work)
    res = json.loads(out.read_text())
    tokens = sum(res["gen_tokens"])
    return {
        "step_times": res["step_times"],
        "gen_times": res["gen_times"],
        "gen_tokens": res["gen_tokens"],
        "rewards": res["rewards"],
        "peak_mb": peak,
        "tokens": tokens,
    }


def hybridflow_side(args, parquet: str, prompts: int, work: Path, layout: str) -> dict:
    """One hybridflow run; layout "1" or "2": that many Ray workers sharing 2 threads; "local": one
    worker in the controller's process (no Ray processes)."""
    workers = 1 if layout == "local" else int(layout)
    run_dir = work / f"hf_{prompts}_{layout}"
    overrides = [
        f"data.train_files=[{parquet}]",
        f"data.val_files=[{parquet}]",
        "data.shuffle=false",
        f"data.train_batch_size={prompts}",
        "data.max_prompt_length=64",
        "data.max_response_length=32",
        "rollout.n=4",
        f"actor.ppo_mini_batch_size={prompts}",
        "actor.ppo_micro_batch_size_per_device=16",
        f"actor.optim.lr={args.lr}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.log_dir={run_dir}",
        f"trainer.default_local_dir={run_dir / 'ckpt'}",
        f"trainer.n_workers_per_node={workers}",
        f"trainer.cpus_per_worker={2 // workers}",
        f"actor.lora.rank={args.lora_rank}",
        f"actor.lora.alpha={args.lora_alpha}",
        *(["trainer.backend=local"] if layout == "local" else []),
        *args.overrides,
    ]
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1"}
    peak, _ = run_measured([sys.executable, "-m", "hybridflow.cli.train", *overrides], env, work)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r]
    completions = prompts * 4
    gen_tokens = [r["response_length/mean"] * completions for r in rows]
    return {
        "step_times": [r["timing_s/step"] for r in rows],
        "gen_times": [r["timing_s/gen"] for r in rows],
        "gen_tokens": gen_tokens,
        "rewards": [r["critic/score/mean"] for r in rows],
        "peak_mb": peak,
        "tokens": sum(gen_tokens),
        "phases": phase_medians(rows),
    }


def phase_medians(rows: list[dict]) -> dict[str, float]:
    """Median of every timing_s/ metric over the steps that report it (weight_sync: from step 2 on)."""
    names = dict.fromkeys(k for r in rows for k in r if k.startswith("timing_s/"))
    return {k: statistics.median(r[k] for r in rows if k in r) for k in names}


def summarize(r: dict) -> dict:
    return {
        "median_step_s": statistics.median(r["step_times"]),
        "gen_tok_per_s": r["tokens"] / sum(r["gen_times"]),
        "e2e_tok_per_s": r["tokens"] / sum(r["step_times"]),
        "peak_mb": r["peak_mb"],
        "mean_reward": statistics.mean(r["rewards"]),
        # standard error of the mean over steps: how far apart two runs' means may be by sampling alone
        "reward_se": statistics.stdev(r["rewards"]) / len(r["rewards"]) ** 0.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sizes", default="2,8", help="prompts per step (x4 samples), comma-separated")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--workers",
        default="1,2,local",
        help="hybridflow layouts to run, as workers sharing the 2 threads (1: one worker with "
        "2 threads; 2: two workers with 1 thread each; local: one worker with 2 threads in the "
        "controller's process, trainer.backend=local), comma-separated",
    )
    parser.add_argument("--skip-trl", action="store_true", help="run only the hybridflow side (quick checks)")
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="both sides train LoRA adapters of this rank on every linear layer (0: full weights)",
    )
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument(
        "--trl-precision",
        choices=["auto", "fp32", "bf16-autocast", "bf16"],
        default="auto",
        help="TRL's precision; auto: what a TRL user picks on this CPU, by hybridflow's own dtype probe "
        "(bf16 autocast where bf16 matmuls pay, fp32 where they do not)",
    )
    parser.add_argument("overrides", nargs="*", help="extra hybridflow key=value overrides")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from hybridflow.utils.hardware import auto_compute_dtype, describe_cpu

    if args.trl_precision == "auto":
        args.trl_precision = "bf16-autocast" if auto_compute_dtype("cpu", 2) == "bf16" else "fp32"

    print(
        describe_cpu(2),
        "(TRL: 1 process x 2 threads; hf 1x2: 1 worker x 2; hf 2x1: 2 workers x 1; "
        "hf local: 1 worker x 2 in the controller's process)",
        flush=True,
    )
    print(f"TRL precision: {args.trl_precision}", flush=True)
    from hybridflow.data.tasks import build_task
    from hybridflow.models import default_model_dir

    model_dir = str(default_model_dir())
    work = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    parquet, _ = build_task("arithmetic", work / "data", 512, 16, seed=0)
    for prompts in [int(s) for s in args.sizes.split(",")]:
        runs = {} if args.skip_trl else {"TRL": trl_side(args, model_dir, parquet, prompts, work)}
        for layout in args.workers.split(","):
            name = "hf local" if layout == "local" else f"hf {layout}x{2 // int(layout)}"
            runs[name] = hybridflow_side(args, parquet, prompts, work, layout)
        lora = f", LoRA rank {args.lora_rank}" if args.lora_rank else ""
        print(f"\n== {prompts} prompts x 4 samples = {prompts * 4} completions/step, {args.steps} steps{lora} ==")
        print_table(runs)


def print_table(runs: dict[str, dict]) -> None:
    """One column per run (hf WxT: W workers x T threads); ratios against TRL's column when it ran."""
    s = {name: summarize(r) for name, r in runs.items()}
    names = list(runs)
    print(f"{'':22}" + "".join(f"{n:>12}" for n in names))
    for label, key, fmt in [
        ("median step (s)", "median_step_s", "12.2f"),
        ("gen tokens/s (gen)", "gen_tok_per_s", "12.1f"),
        ("gen tokens/s (e2e)", "e2e_tok_per_s", "12.1f"),
        ("peak memory (MiB)", "peak_mb", "12.0f"),
        ("mean reward", "mean_reward", "12.3f"),
        ("  s.e. over steps", "reward_se", "12.3f"),
    ]:
        print(f"{label:22}" + "".join(format(s[n][key], fmt) for n in names))
    if "TRL" in s:
        t = s["TRL"]
        for n in names[1:]:
            print(
                f"{n}: step {t['median_step_s'] / s[n]['median_step_s']:.2f}x faster than TRL, generated "
                f"tokens/s {s[n]['gen_tok_per_s'] / t['gen_tok_per_s']:.2f}x (gen), "
                f"{s[n]['e2e_tok_per_s'] / t['e2e_tok_per_s']:.2f}x (e2e)"
            )
    for n, r in runs.items():
        print(f"reward per step  {n:>8}: " + " ".join(f"{x:.2f}" for x in r["rewards"]))
    for n, r in runs.items():
        if "phases" in r:
            print(
                f"{n} median phase times (s): "
                + ", ".join(f"{k.removeprefix('timing_s/')} {v:.2f}" for k, v in r["phases"].items())
            )


if __name__ == "__main__":
    main()
