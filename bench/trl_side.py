"""TRL side of bench/vs_trl.py: GRPO with TRL's `GRPOTrainer`, timed step by step.

Runs inside the benchmark-only environment `.venv-trl` (bench/setup_trl_env.sh);
TRL is not a hybridflow dependency and hybridflow is not importable there, so
the arithmetic scorer below is a self-contained copy of the rule in
`hybridflow.rewards.arithmetic` (number after the last `####`, else the last
number in the response; 1.0 when it equals the ground truth exactly).

One optimizer step = `prompts_per_step` prompts x `num_generations` samples:
per_device_train_batch_size = completions per step, gradient accumulation 1,
one policy update per generation batch (num_iterations 1), beta 0 (no KL, no
reference model), sampling at temperature 1 with top-p 1 and no top-k, no vLLM.
Prompts are taken in file order (no shuffle) so hybridflow can be fed exactly
the same batches. Step time runs from `on_step_begin` to `on_step_end`:
generation, scoring, log-probs, loss, backward and the optimizer step.

Departures from the hybridflow side that TRL 1.16 imposes: it has no
`max_prompt_length` (it never truncates prompts), so an over-long prompt is an
error here instead; its default loss aggregation is "dapo" (token mean over the
batch), kept and recorded.

    .venv-trl/bin/python bench/trl_side.py --model-dir DIR --train-parquet F --out trl.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

PRECISIONS = {
    "bf16-autocast": "fp32 master weights, forward/backward under bf16 autocast; TRL generates in fp32",
    "fp32": "fp32 weights and compute",
    "bf16": "bf16 weights and compute (small updates can be lost)",
}

# ---- scorer: mirrors hybridflow.rewards.arithmetic + hybridflow.rewards.extract ----
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")


def _parse_number(text: str) -> Fraction | None:
    """`text` as an exact number ("1,234", "-3", "2.50", "3/4"); None if it is not one."""
    text = text.strip().replace(",", "").rstrip(".").replace(" ", "")
    if text.count("/") == 1:
        num, den = (_parse_number(part) for part in text.split("/"))
        return None if num is None or den is None or den == 0 else num / den
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def arithmetic_score(solution: str, ground_truth: str) -> float:
    """1.0 when the answer after the last `####` (else the last number) equals `ground_truth`."""
    found = _HASHES_RE.findall(solution) or _NUMBER_RE.findall(solution)
    if not found:
        return 0.0
    got, want = _parse_number(found[-1]), _parse_number(ground_truth)
    return 1.0 if got is not None and got == want else 0.0


# ---- command line ----
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's knobs; defaults are issue 6's settings except --steps and --threads."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--train-parquet", required=True, help="verl-format parquet: prompt, reward_model.ground_truth")
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-prompt-length", type=int, default=64)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16-autocast")
    p.add_argument("--loss-type", default="dapo", help="TRL loss_type (dapo = token mean over the batch)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off here (faster)")
    p.add_argument(
        "--omp-wait-policy",
        choices=["passive", "active", "inherit"],
        default="passive",
        help="OMP_WAIT_POLICY; passive is ~10x faster at generation on an oversubscribed machine",
    )
    p.add_argument("--lora-rank", type=int, default=0, help="train peft LoRA adapters of this rank (0: full)")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--out", required=True, help="where to write the JSON results")
    args = p.parse_args(argv)
    if args.num_generations < 2:
        p.error(f"--num-generations must be >= 2 for GRPO group statistics, got {args.num_generations}")
    if min(args.prompts_per_step, args.steps, args.threads) < 1:
        p.error("--prompts-per-step, --steps and --threads must all be >= 1")
    return args


def pin_threads(threads: int, wait_policy: str) -> None:
    """Pin OpenMP/MKL and torch to `threads`; must run before torch is imported."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    # Spinning OpenMP threads starve each other when other processes share the cores:
    # small per-token kernels then run many times slower, so the policy is recorded.
    if wait_policy != "inherit":
        os.environ["OMP_WAIT_POLICY"] = wait_policy.upper()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- data ----
def load_prompts(path: str, tokenizer: Any, max_prompt_length: int, needed: int):
    """The parquet as a TRL conversational dataset: `prompt` (chat list) and `ground_truth`."""
    import datasets
    import pandas as pd

    df = pd.read_parquet(path)
    missing = {"prompt", "reward_model"} - set(df.columns)
    if missing:
        sys.exit(f"{path}: missing verl columns {sorted(missing)}; build it with hybridflow.data.build_task")
    if len(df) < needed:
        sys.exit(f"{path}: {len(df)} rows but --steps x --prompts-per-step needs {needed}; use a larger file")
    df = df.iloc[:needed]
    prompts = [[{"role": m["role"], "content": m["content"]} for m in chat] for chat in df["prompt"]]
    truths = [str(rm["ground_truth"]) for rm in df["reward_model"]]
    for i, chat in enumerate(prompts):
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > max_prompt_length:
            sys.exit(
                f"{path} row {i}: prompt is {n} tokens > --max-prompt-length {max_prompt_length}; "
                "TRL does not truncate prompts, so use shorter prompts or raise the limit on both sides"
            )
    return datasets.Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


# ---- measurement ----
class Recorder:
    """Per-step measurements, fed by the reward function, a generate wrapper and a callback."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.gen_times: list[float] = []
        self.gen_tokens: list[int] = []
        self.rewards: list[float] = []
        self.logs: list[dict[str, float]] = []

    def reward_func(self):
        """A TRL reward function that scores with `arithmetic_score` and counts generated tokens."""

        def arithmetic_reward(completions, ground_truth, completion_ids, **_: Any) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            scores = [arithmetic_score(t, g) for t, g in zip(texts, ground_truth)]
            self.gen_tokens.append(sum(len(ids) for ids in completion_ids))
            self.rewards.append(sum(scores) / len(scores))
            return scores

        return arithmetic_reward

    def time_generate(self, model: Any) -> None:
        """Wrap `model.generate` so each call's wall time is recorded (TRL only profiles to wandb)."""
        original = model.generate

        def timed_generate(*args: Any, **kwargs: Any):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.gen_times.append(time.perf_counter() - start)
            return out

        model.generate = timed_generate

    def callback(self):
        """A TrainerCallback timing each optimizer step and keeping TRL's per-step logs."""
        from transformers import TrainerCallback

        rec = self

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                rec.step_times.append(time.perf_counter() - self.start)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    rec.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})
                    print(
                        f"[trl] step {state.global_step}: {rec.step_times[-1]:.2f}s "
                        f"reward {logs['reward']:.3f} tokens {rec.gen_tokens[-1]}",
                        flush=True,
                    )

        return StepTimer()


# ---- run ----
def grpo_config(args: argparse.Namespace, out_dir: str):
    """TRL GRPOConfig for one optimizer step per batch of prompts x generations."""
    from trl import GRPOConfig

    completions = args.prompts_per_step * args.num_generations
    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_steps=args.steps,
        per_device_train_batch_size=completions,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        num_iterations=1,
        beta=0.0,
        loss_type=args.loss_type,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,
        bf16=args.precision != "fp32",
        gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs={"dtype": "bfloat16" if args.precision == "bf16" else "float32"},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def peft_config(args: argparse.Namespace):
    """peft LoRA on every linear layer but the LM head (hybridflow's actor.lora defaults), or None."""
    if args.lora_rank <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )


def summary(rec: Recorder) -> dict[str, float]:
    """Headline numbers; tokens/s divides all generated tokens by all step (or generate) time."""
    total_time, total_tokens = sum(rec.step_times), sum(rec.gen_tokens)
    return {
        "median_step_time_s": statistics.median(rec.step_times),
        "tokens_per_s": total_tokens / total_time,
        "median_gen_time_s": statistics.median(rec.gen_times) if rec.gen_times else float("nan"),
        "generate_tokens_per_s": total_tokens / sum(rec.gen_times) if rec.gen_times else float("nan"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train `args.steps` GRPO steps with TRL and return the results record."""
    pin_threads(args.threads, args.omp_wait_policy)
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    if not (Path(args.model_dir) / "config.json").is_file():
        sys.exit(
            f"--model-dir {args.model_dir}: no config.json; pass an HF model directory "
            "(hybridflow.models.default_model_dir() prints the default one)"
        )
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, padding_side="left", truncation_side="left")
    dataset = load_prompts(args.train_parquet, tokenizer, args.max_prompt_length, args.steps * args.prompts_per_step)
    rec = Recorder()
    with tempfile.TemporaryDirectory(prefix="trl_side_") as out_dir:
        trainer = GRPOTrainer(
            model=args.model_dir,
            reward_funcs=rec.reward_func(),
            args=grpo_config(args, out_dir),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[rec.callback()],
            peft_config=peft_config(args),
        )
        rec.time_generate(trainer.model)
        init_time, rss_after_init = time.perf_counter() - start, rss_mb()
        trainer.train()
    return {
        "framework": "trl",
        "version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": args.precision,
        "dtype_note": PRECISIONS[args.precision],
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "completions_per_step": args.prompts_per_step * args.num_generations,
            "beta": 0.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "shuffle": False,
            "torch_threads": torch.get_num_threads(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", ""),
        },
        "step_times": rec.step_times,
        "gen_times": rec.gen_times,
        "gen_tokens": rec.gen_tokens,
        "rewards": rec.rewards,
        **summary(rec),
        "init_time_s": init_time,
        "rss_after_init_mb": rss_after_init,
        "peak_rss_mb": rss_mb(),
        "trl_logs": rec.logs,
    }


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, write the JSON record and print the headline numbers."""
    args = parse_args(argv)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"[trl] median step {result['median_step_time_s']:.2f}s, {result['tokens_per_s']:.1f} tokens/s, "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB -> {args.out}",
        flush=True,
    )


if __name__ == "__main__":
    main()
