"""The weight-sync fingerprints' cost (hybridflow/parity/weights.py) against the sync they check.

SmolLM2-135M in one process: a one-rank FSDP2 engine (fp32 master weights) synced into a native rollout of
rollout dtype fp32 and bf16 (`sync_weights`, colocated path: gather in the rollout's dtype, load), each round
with the check on; per round the sync without the check (`timing_s/weight_sync` - `timing_s/parity_weights`), the
check (both sides' fingerprints) and, as a yardstick that a busy machine slows alike, one copy of the weights.

    PYTHONPATH=. .venv/bin/python bench/parity_weights.py --rounds 5 --threads 2

`--rollout vllm` (in .venv-vllm; one dtype per process, `--dtypes fp32`): the same into an in-process vllm
engine, whose side vllm's worker fingerprints (rollout/vllm/weights.py); the copy is of the engine's weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _measure(name: str, dtype: str, rounds: int) -> tuple[list[float], list[float], list[float], int]:
    from hybridflow.engine import EngineConfig, FSDPEngine
    from hybridflow.models import default_model_dir, load_tokenizer
    from hybridflow.rollout import RolloutConfig, build_rollout, sync_weights

    path = default_model_dir()
    engine = FSDPEngine.from_pretrained(path, EngineConfig(param_dtype="fp32"))
    cfg = RolloutConfig(name=name, dtype=dtype, prompt_length=64, response_length=8, max_batch_size=4)
    rollout = build_rollout(cfg, path, load_tokenizer(path))
    held = rollout.held_weights() or dict(engine.module.named_parameters())
    unique = list({id(t): t for t in held.values()}.values())
    sync, check, copy = [], [], []
    for step in range(rounds + 1):  # the first round warms up
        report = sync_weights(rollout, engine, step=step, check=True, backend=name)
        assert report.findings == [], report.findings
        sync.append(report.seconds - report.check_seconds)  # the sync without its check
        check.append(report.check_seconds)
        start = time.perf_counter()
        [t.detach().clone() for t in unique]
        copy.append(time.perf_counter() - start)
    return sync[1:], check[1:], copy[1:], sum(t.numel() for t in unique)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rollout", choices=("native", "vllm"), default="native")
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    args = parser.parse_args()
    from hybridflow.utils.hardware import describe_cpu

    torch.set_num_threads(args.threads)
    print(describe_cpu(args.threads), flush=True)
    for dtype in args.dtypes:
        sync, check, copy, elements = _measure(args.rollout, dtype, args.rounds)
        s, c, k = (statistics.median(x) for x in (sync, check, copy))
        print(
            f"{args.rollout} {dtype}: {elements / 1e6:.1f}M elements; medians: sync {s:.3f} s, parity_weights {c:.3f} s "
            f"({c / s:.2f}x the sync), one copy of the weights {k:.3f} s ({c / k:.2f}x); rounds: sync "
            f"{[round(x, 3) for x in sync]}, check {[round(x, 3) for x in check]}, copy {[round(x, 3) for x in copy]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
