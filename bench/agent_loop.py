"""Multi-turn agent rollout vs single-turn rollout on the same batch: generated tokens/s (the agent loop's
overhead), with and without the KV cache kept across turns, and the loop's time split between the model and the
tools (issues 29, 55).

    .venv/bin/python bench/agent_loop.py                        # SmolLM2-135M-Instruct, 16 tool_arithmetic prompts
    .venv/bin/python bench/agent_loop.py --tool python          # the same prompts offering the python sandbox
    .venv/bin/python bench/agent_loop.py --tiny --rounds 1      # tiny random model: checks that it runs

One native rollout (in-process, no Ray), one batch of `tool_arithmetic` prompts rendered as the `tool`
environment renders them (its tools system prompt included), the training sampling (T=1, top_p 1,
EOS stops), log-probs on. Every round runs the variants (`--variants`, default all) one after the other, each after
reseeding the sampler to the same seed:
- `single`: `rollout.generate_sequences` on the batch, response_length tokens at most;
- `mt1`: the multi-turn rollout (`generate_multi_turn`, what the worker runs with rollout.multi_turn)
  with max_assistant_turns=1, on the native rollout's turn engine (rollout/native/turns.py): one turn, so its
  ratio is the loop's and the engine's cost (rows, environments, per-trajectory sampling, building the batch) over
  one generate call (its samples are not `single`'s: each trajectory draws from its own generator);
- `mt`: the multi-turn rollout with --turns turns, the model as is. The base model seldom calls the
  calculator, so this is mostly one turn; its tool-call rate is printed beside it;
- `forced`: as `mt`, but every trajectory's first turn is the ideal tool call (the calculator's is the
  `transcript(row)` turn; `--tool python` offers the python sandbox instead and calls it with
  `print(a * b)`): the engine decodes that turn token by token, each sampled token replaced by the call's, so it
  costs the decode steps a model that calls the tool would spend and the cache holds the call. The tool runs, its
  result is appended and the model samples freely from there. This is the realistic case of a tool-using policy:
  the turn engine keeps each trajectory's KV cache, so the second turn runs only the call's stop id and the
  observation, and the trajectories whose tool returned decode while others' tools run (the calculator takes
  microseconds; a sandboxed python run starts a process, tenths of a second, 8 at a time:
  `AgentLoopConfig.max_parallel_steps`);
- `forced_nokv`: `forced` on a turn engine that re-runs every turn's whole context (`reuse_kv=False`);
- `forced_rounds`: `forced` on the round path that was the only one before the turn engine
  (`ModuleRollout.turn_generator`: one `generate_sequences` call per round on every running context, re-prefilled,
  the round waiting for its slowest tool call; the first call decodes with EOS off to the longest forced turn).

Tokens/s counts model tokens only (response_mask == 1; forced tokens count: they were decoded) over the
wall time of the whole call. A ratio is a variant's tokens/s over `single`'s in the same round (< 1:
the loop costs); median and min over rounds. The time split of a multi-turn call (the loop's metrics): `generate`
(in the engine), `tools` (the summed duration of every environment step, overlapping decoding and each other) and
`wait` (the loop blocked on environments with nothing to decode; env share = wait / the call).
One short warm-up call per variant comes first. Only ratios within one run mean anything on a shared CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from hybridflow.agent.config import MultiTurnConfig
from hybridflow.agent.loop.env import make_env
from hybridflow.agent.loop.tokens import encode, prompt_ids
from hybridflow.agent.loop.tool_calls import format_tool_call
from hybridflow.data.tasks import make_difficulty, make_rows
from hybridflow.models import load_tokenizer, resolve_model_path, tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.base import ModuleRollout, left_padded
from hybridflow.rollout.multi_turn import generate_multi_turn
from hybridflow.rollout.native.rollout import NativeRollout
from hybridflow.utils.hardware import cpu_signature, describe_cpu

VARIANTS = ("single", "mt1", "mt", "forced", "forced_nokv", "forced_rounds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help='local HF directory, or "default" (SmolLM2-135M-Instruct)')
    parser.add_argument("--tiny", action="store_true", help="tiny random model, small sizes, no matmul header")
    parser.add_argument("--batch", type=int, default=16, help="prompts (trajectories) per call")
    parser.add_argument("--response-length", type=int, default=256, help="model + observation tokens per row")
    parser.add_argument("--turns", type=int, default=MultiTurnConfig.max_assistant_turns, help="mt/forced turns")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--tool", default="calculator", choices=["calculator", "python"], help="the tool offered")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS)
    )
    args = parser.parse_args(argv)
    args.variants = [v for v in VARIANTS if v in args.variants.split(",")]
    if "single" not in args.variants or len(args.variants) < 2:
        parser.error(f"--variants must name 'single' and at least one other of {', '.join(VARIANTS)}")
    if args.tiny:
        args.model, args.batch, args.response_length = str(tiny_model_dir("llama")), min(args.batch, 4), 96
    if min(args.batch, args.response_length, args.turns, args.rounds, args.threads or 1) < 1:
        parser.error("--batch, --response-length, --turns, --rounds and --threads must be >= 1")
    return args


def prompt_batch(tokenizer: Any, rows: list[dict[str, Any]]) -> DataProto:
    """The rows as RLDataset would batch them, with the prompt ids the `tool` environment renders."""
    ids = []
    for row in rows:
        start = make_env("tool", allowed_tools=["calculator", "python"]).reset(row)
        ids.append(prompt_ids(tokenizer, start.messages, start.tools))
    batch = left_padded(ids, tokenizer.pad_token_id)
    columns = {
        K.RAW_PROMPT: [row["prompt"] for row in rows],
        K.DATA_SOURCE: [row["data_source"] for row in rows],
        K.GROUND_TRUTH: [row["reward_model"]["ground_truth"] for row in rows],
        K.EXTRA_INFO: [row["extra_info"] for row in rows],
        "index": list(range(len(rows))),
    }
    for key, values in columns.items():
        batch.non_tensor_batch[key] = np.array(values + [None], dtype=object)[:-1]
    return batch


def offer_tool(rows: list[dict[str, Any]], tool: str) -> list[dict[str, Any]]:
    """The rows with `tool` as the one tool they offer (the task's own is the calculator)."""
    return [{**row, "extra_info": {**row["extra_info"], "tools": json.dumps([tool])}} for row in rows]


def forced_turns(tokenizer: Any, rows: list[dict[str, Any]], tool: str, stop_id: int) -> list[list[int]]:
    """Each row's ideal first turn as the model would sample it: the call's ids and the stop id."""
    expressions = [row["extra_info"]["expression"] for row in rows]
    calls = [
        format_tool_call("calculator", {"expression": e})
        if tool == "calculator"
        else format_tool_call("python", {"code": f"print({e})"})
        for e in expressions
    ]
    return [encode(tokenizer, text) + [stop_id] for text in calls]


@contextlib.contextmanager
def forced_first_call(rollout: ModuleRollout, turns: list[list[int]]) -> Iterator[None]:
    """The rollout's next generate call decodes max(len(turns)) tokens per row with EOS off, then returns
    `turns` as its samples (log-probs 0); later calls sample as usual (module docstring: `forced`)."""
    plain, calls = rollout.generate_sequences, [0]

    def generate(prompts: DataProto, sampling=None) -> DataProto:
        calls[0] += 1
        if calls[0] > 1:
            return plain(prompts, sampling)
        width, base = max(map(len, turns)), rollout.config
        rollout.config = dataclasses.replace(base, ignore_eos=True, response_length=width)
        try:
            plain(prompts, sampling)
        finally:
            rollout.config = base
        ids = torch.full((len(turns), width), rollout.pad_id)
        mask = torch.zeros((len(turns), width), dtype=torch.long)
        for i, turn in enumerate(turns):
            ids[i, : len(turn)], mask[i, : len(turn)] = torch.tensor(turn), 1
        return DataProto.from_dict({K.RESPONSES: ids, K.RESPONSE_MASK: mask, K.ROLLOUT_LOG_PROBS: mask * 0.0})

    rollout.generate_sequences = generate
    try:
        yield
    finally:
        del rollout.generate_sequences  # the class's method again


@contextlib.contextmanager
def forced_engine(rollout: NativeRollout, turns: list[list[int]], reuse_kv: bool) -> Iterator[None]:
    """The multi-turn rollout runs on a turn engine (`reuse_kv` as given) whose first turn of every trajectory is
    `turns[key]`: each sampled token is replaced by the call's (log-prob 0), so the turn ends on its stop id."""

    def turn_generator(sampling):
        engine = rollout.turn_engine(sampling, reuse_kv)
        if engine is None:
            raise TypeError("the native rollout's turn engine does not cover this model (no fused decode step)")
        plain_sample, plain_advance, first_done = engine.sample, engine.advance, set()

        def sample(keys, logits):
            tokens, logp = plain_sample(keys, logits)  # the draw's cost, as a sampled call would pay it
            for i, key in enumerate(keys):
                if key not in first_done:
                    tokens[i], logp[i] = turns[key][len(engine.trajs[key].ids)], 0.0
            return tokens, logp

        def advance():
            ended = plain_advance()
            first_done.update(key for key, _ in ended)
            return ended

        engine.sample, engine.advance = sample, advance
        return contextlib.nullcontext(engine)

    rollout.turn_generator = turn_generator
    try:
        yield
    finally:
        del rollout.turn_generator  # the class's method again


@contextlib.contextmanager
def round_path(rollout: ModuleRollout) -> Iterator[None]:
    """The multi-turn rollout runs on `ModuleRollout`'s round path (a `generate_sequences` call per round)."""
    rollout.turn_generator = lambda sampling: ModuleRollout.turn_generator(rollout, sampling)
    try:
        yield
    finally:
        del rollout.turn_generator


def variant_context(name: str, rollout: NativeRollout, turns: list[list[int]]) -> contextlib.AbstractContextManager:
    """How variant `name` generates its turns (module docstring)."""
    if name == "forced":
        return forced_engine(rollout, turns, reuse_kv=True)
    if name == "forced_nokv":
        return forced_engine(rollout, turns, reuse_kv=False)
    if name == "forced_rounds":
        stack = contextlib.ExitStack()
        stack.enter_context(round_path(rollout))
        stack.enter_context(forced_first_call(rollout, turns))
        return stack
    return contextlib.nullcontext()


def run_variant(name: str, rollout: NativeRollout, prompts: DataProto, config: RolloutConfig, turns) -> dict:
    """One call of variant `name`: seconds, model tokens, and (multi-turn) the loop's metrics and tool use."""
    sampling = config.sampling_params()
    if name == "single":
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts, sampling)
        seconds = time.perf_counter() - start
        return {"s": seconds, "tokens": int(out.batch[K.RESPONSE_MASK].sum())}
    most = 1 if name == "mt1" else config.multi_turn.max_assistant_turns
    cfg = dataclasses.replace(config, multi_turn=dataclasses.replace(config.multi_turn, max_assistant_turns=most))
    with variant_context(name, rollout, turns):
        start = time.perf_counter()
        out = generate_multi_turn(rollout, prompts, sampling, cfg)
        seconds = time.perf_counter() - start
    columns = out.non_tensor_batch
    return {
        "s": seconds,
        "tokens": int(out.batch[K.RESPONSE_MASK].sum()),
        "tool_call_rate": float((columns[K.TOOL_CALLS].astype(float) > 0).mean()),
        "turns": float(columns[K.NUM_TURNS].astype(float).mean()),
        **out.meta_info[K.META_METRICS],
    }


def setup(args: argparse.Namespace) -> tuple[NativeRollout, DataProto, RolloutConfig, list[list[int]]]:
    """The rollout, the prompt batch, the multi-turn config and the forced first turns."""
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    rows = make_rows("tool_arithmetic", args.batch, "train", args.seed, make_difficulty("tool_arithmetic"))
    rows = offer_tool(rows, args.tool)
    prompts = prompt_batch(tokenizer, rows)
    config = RolloutConfig(
        name="native",
        dtype=args.dtype,
        prompt_length=prompts.batch[K.INPUT_IDS].shape[1],
        response_length=args.response_length,
        max_batch_size=args.batch,
        calculate_log_probs=True,
        seed=args.seed,
        multi_turn=MultiTurnConfig(
            enable=True, max_assistant_turns=args.turns, max_user_turns=args.turns, allowed_tools=[args.tool]
        ),
    )
    rollout = build_rollout(dataclasses.replace(config, multi_turn=MultiTurnConfig()), path, tokenizer)
    if not isinstance(rollout, NativeRollout):
        raise TypeError(f"expected the in-process native rollout, got {type(rollout).__name__}")
    return rollout, prompts, config, forced_turns(tokenizer, rows, args.tool, rollout.eos_ids[0])


def measure(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Warm up each variant on two rows, then `rounds` rounds of every variant, each reseeded alike."""
    rollout, prompts, config, turns = setup(args)
    print(
        f"model {args.model}, native rollout, {rollout.weight_dtype}, batch {args.batch} tool_arithmetic prompts "
        f"offering {args.tool}, "
        f"response_length {args.response_length}, turns {args.turns}, T=1, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    warm = dataclasses.replace(config, response_length=min(config.response_length, 48))
    for name in args.variants:
        run_variant(name, rollout, prompts[:2], warm, turns[:2])
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for r in range(args.rounds):
        for name in args.variants:
            rollout.reseed(r)
            res = run_variant(name, rollout, prompts, config, turns)
            runs[name].append(res)
            extra = ""
            if name != "single":
                extra = (
                    f", {res['turns']:.2f} turns, tool calls {res['tool_call_rate']:.2f}; generate "
                    f"{res['agent/generate_time_s']:.2f} s in {res['agent/rounds']:.0f} calls, tools "
                    f"{res['agent/tool_time_s']:.2f} s, wait {res['agent/env_time_s']:.2f} s (env share "
                    f"{res['agent/env_time_share']:.3f})"
                )
            print(
                f"  round {r} {name:>13}: {res['s']:6.2f} s, {res['tokens']:5d} tokens, "
                f"{res['tokens'] / res['s']:7.1f} tokens/s{extra}",
                flush=True,
            )
    return runs


SPLIT = (
    ("env_share", "agent/env_time_share"),
    ("tool_call_rate", "tool_call_rate"),
    ("turns", "turns"),
    ("generate_s", "agent/generate_time_s"),
    ("tool_s", "agent/tool_time_s"),
    ("wait_s", "agent/env_time_s"),
    ("call_s", "s"),
)
"""Summary key -> the per-call figure it is the median of (multi-turn variants)."""


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per variant: median tokens/s, the median and min of its per-round ratio to single; for multi-turn ones the
    medians of env share, tool use and the time split."""
    rate = {name: [r["tokens"] / r["s"] for r in rs] for name, rs in runs.items()}
    out = {}
    for name in runs:
        ratios = [v / s for v, s in zip(rate[name], rate["single"])]
        row = {
            "tokens_per_s": statistics.median(rate[name]),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
        }
        if name != "single":
            row.update({key: statistics.median(r[metric] for r in runs[name]) for key, metric in SPLIT})
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print the header, the rounds, a table and the one-line summary; return the summary."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_signature()} (matmul probe skipped: --tiny)" if args.tiny else describe_cpu(), flush=True)
    print("command: " + shlex.join(["python", "bench/agent_loop.py", *(sys.argv[1:] if argv is None else argv)]))
    summary = summarize(measure(args))
    print(
        f"{'variant':>13} {'tokens/s':>9} {'ratio':>6} {'min':>6} {'env share':>10} {'tool calls':>11} {'turns':>6} "
        f"{'call s':>7} {'generate s':>11} {'tools s':>8} {'wait s':>7}"
    )
    for name, row in summary.items():
        tail = ""
        if name != "single":
            tail = (
                f" {row['env_share']:10.3f} {row['tool_call_rate']:11.2f} {row['turns']:6.2f} {row['call_s']:7.2f} "
                f"{row['generate_s']:11.2f} {row['tool_s']:8.2f} {row['wait_s']:7.2f}"
            )
        print(f"{name:>13} {row['tokens_per_s']:9.1f} {row['ratio']:6.3f} {row['ratio_min']:6.3f}{tail}")
    others = [n for n in summary if n != "single"]
    print(
        "summary: tokens/s vs single (median, min over "
        f"{args.rounds} rounds): "
        + ", ".join(f"{n} {summary[n]['ratio']:.3f} (min {summary[n]['ratio_min']:.3f})" for n in others)
        + "; env share: "
        + ", ".join(f"{n} {summary[n]['env_share']:.3f}" for n in others)
        + "; tool-call rate: "
        + ", ".join(f"{n} {summary[n]['tool_call_rate']:.2f}" for n in others),
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
