"""The token-exact multi-turn agent loop over any "generate one turn for a batch" function.

`run_agent_loop(rows, env_factory, generate, tokenizer, config)` runs one trajectory per row,
all of them together: each round it calls `generate` once on the token ids of every
trajectory still running, hands each decoded turn to that trajectory's environment (the
steps of a round run concurrently in a thread pool, so slow tools overlap), and appends the
observations. A trajectory is kept as token ids exactly as sampled:
- model tokens are appended as `generate` returned them (never decoded and re-encoded),
  with `response_mask` 1 and their sampling log-probs;
- observation tokens are the template's rendering of the observation messages, tokenized
  once (`tokens.observation_ids`), with `response_mask` 0 and log-prob 0.

A trajectory stops when the environment says done ("done"), after `max_assistant_turns`
model turns or `max_user_turns` observation turns, when a turn ends without a stop token
(the per-turn or total budget ran out: "length"), or when the next observation would not fit
in `response_length` ("response_length"; the observation is then not appended). Per-turn
rewards sit on the last token of their model turn (`reward_positions`).

`generate(batch, max_new_tokens)` gets one list of token ids per running trajectory (the
prompt and everything appended so far) and one new-token limit per row, and returns one
`TurnOutput` per row: the sampled ids, including the stop token when it stopped on one, and
their log-probs (or None).

An environment that raises fails the loop with one line naming the environment, the row and
the error.

`times` (a `LoopTimes`, optional) gets the call's wall time split into `generate` calls, waiting on
the environments (`reset` and the rounds' `step` calls, where tools run) and the rest (decoding turns,
tokenizing observations); `LoopTimes.metrics()` gives them as `agent/*` metrics. A few clock reads
per round, so they are always taken.

Departures from verl's `ToolAgentLoop`: one function over a batch instead of one asyncio task
per trajectory; generation is batched per round, so a round waits for its slowest tool call
(verl overlaps a trajectory's tool call with other trajectories' generation); `response_length`
counts model and observation tokens alike (as verl's), while `max_turn_tokens` caps one turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agent.loop.env import Environment, StepResult
from hybridflow.agent.loop.tokens import observation_ids, prompt_ids

Message = dict[str, Any]


@dataclass
class TurnOutput:
    """One model turn as sampled."""

    token_ids: list[int]
    """Sampled ids, ending with the stop token when the turn stopped on one."""
    log_probs: list[float] | None = None
    """The sampler's log-prob of each sampled id (None: not computed)."""
    versions: list[int] | None = None
    """The policy version whose weights sampled each id (None: not known; recorded as -1)."""


GenerateFn = Callable[[list[list[int]], list[int]], list[TurnOutput]]


@dataclass
class AgentLoopConfig:
    """Limits of the multi-turn loop (verl's names where it has them)."""

    response_length: int = 512
    """Most tokens after the prompt, model and observation tokens together."""
    max_turn_tokens: int = 256
    """Most new tokens of one model turn."""
    max_assistant_turns: int = 4
    """Most model turns per trajectory."""
    max_user_turns: int = 4
    """Most observation turns (environment replies) per trajectory."""
    max_parallel_steps: int = 8
    """Environment steps of one round run concurrently in this many threads."""

    def __post_init__(self) -> None:
        for name in ("response_length", "max_turn_tokens", "max_assistant_turns", "max_user_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentLoopConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class LoopTimes:
    """Wall seconds of `run_agent_loop` calls by phase (summed over the calls it was passed to)."""

    generate_s: float = 0.0
    """In `generate` calls."""
    env_s: float = 0.0
    """Waiting on environments: their `reset` calls, and each round's `step` calls (run concurrently,
    so a round counts its slowest step); tool calls run there."""
    total_s: float = 0.0
    """The whole call (generate, environments, and the loop's own decoding and tokenizing)."""
    rounds: int = 0
    """Generate calls (one per round)."""

    def metrics(self, prefix: str = "agent") -> dict[str, float]:
        """`{prefix}/generate_time_s`, `/env_time_s`, `/loop_time_s`, `/rounds` and `/env_time_share`
        (env_s / total_s: the share of the loop spent waiting on environments and tools)."""
        return {
            f"{prefix}/generate_time_s": self.generate_s,
            f"{prefix}/env_time_s": self.env_s,
            f"{prefix}/loop_time_s": self.total_s,
            f"{prefix}/rounds": float(self.rounds),
            f"{prefix}/env_time_share": self.env_s / self.total_s if self.total_s > 0 else 0.0,
        }


@dataclass
class Trajectory:
    """One episode as token ids, with what the trainer needs to train on it."""

    row_index: int
    prompt_ids: list[int]
    tools: list[dict[str, Any]]
    messages: list[Message]
    """The conversation as text (assistant turns decoded), for logs and inspection."""
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    """1: a model token (trained); 0: an observation token (not trained)."""
    rollout_log_probs: list[float] = field(default_factory=list)
    sampled_ids: list[int] = field(default_factory=list)
    """Each model turn's ids as the sampler returned them, concatenated (the token parity check's reference:
    hybridflow/protocol/token_hash.py); the trained ids (`response_mask` 1) must equal them."""
    token_versions: list[int] = field(default_factory=list)
    """Per response token: the policy version that sampled it (`TurnOutput.versions`); -1 on observation tokens."""
    turn_rewards: list[float] = field(default_factory=list)
    reward_positions: list[int] = field(default_factory=list)
    """Index in `response_ids` of the last token of each model turn (where its reward goes)."""
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    stop_reason: str = ""

    @property
    def done(self) -> bool:
        """True once the trajectory stopped (for any reason)."""
        return bool(self.stop_reason)

    @property
    def reward(self) -> float:
        """The sum of the per-turn rewards."""
        return sum(self.turn_rewards)


def run_agent_loop(
    rows: Sequence[dict[str, Any]],
    env_factory: Callable[[], Environment],
    generate: GenerateFn,
    tokenizer: Any,
    config: AgentLoopConfig,
    stop_ids: Sequence[int] | None = None,
    env_name: str = "",
    row_labels: Sequence[str] | None = None,
    times: LoopTimes | None = None,
) -> list[Trajectory]:
    """One trajectory per row, run together (module docstring); `stop_ids` default to the tokenizer's EOS;
    `row_labels` name the rows in an environment's failure (default: "row <index in rows>"); `times`, when
    given, gets this call's phase times added."""
    clock = times if times is not None else LoopTimes()
    begin = time.perf_counter()
    stops = list(stop_ids) if stop_ids is not None else [tokenizer.eos_token_id]
    labels = list(row_labels) if row_labels is not None else [f"row {i}" for i in range(len(rows))]
    envs = [env_factory() for _ in rows]
    trajs = [_start(i, row, env, tokenizer, env_name, labels[i], clock) for i, (row, env) in enumerate(zip(rows, envs))]
    with ThreadPoolExecutor(max_workers=config.max_parallel_steps) as pool:
        while running := [t for t in trajs if not t.done]:
            budgets = [min(config.max_turn_tokens, config.response_length - len(t.response_ids)) for t in running]
            start = time.perf_counter()
            outputs = generate([t.prompt_ids + t.response_ids for t in running], budgets)
            clock.generate_s += time.perf_counter() - start
            clock.rounds += 1
            if len(outputs) != len(running):
                raise ValueError(f"generate returned {len(outputs)} turns for {len(running)} rows")
            texts = [_append_turn(t, out, b, stops, tokenizer) for t, out, b in zip(running, outputs, budgets)]
            stepping = [(t, text) for t, text in zip(running, texts) if not t.done]
            start = time.perf_counter()
            results = list(
                pool.map(lambda tt: _step(envs[tt[0].row_index], tt[1], labels[tt[0].row_index], env_name), stepping)
            )
            clock.env_s += time.perf_counter() - start
            for (traj, _), result in zip(stepping, results):
                _apply_step(traj, result, tokenizer, stops, config)
    clock.total_s += time.perf_counter() - begin
    return trajs


def _start(
    index: int, row: dict[str, Any], env: Environment, tokenizer: Any, env_name: str, label: str, clock: LoopTimes
) -> Trajectory:
    start = time.perf_counter()
    try:
        first = env.reset(row)
    except Exception as exc:
        raise RuntimeError(_env_failure(env, env_name, "reset", label, exc)) from exc
    clock.env_s += time.perf_counter() - start
    ids = prompt_ids(tokenizer, first.messages, first.tools)
    return Trajectory(index, ids, list(first.tools), list(first.messages))


def _append_turn(traj: Trajectory, out: TurnOutput, budget: int, stops: list[int], tokenizer: Any) -> str:
    """Append a sampled turn as is; return its text for the environment (stop token dropped)."""
    ids = list(out.token_ids)[:budget]
    log_probs = list(out.log_probs)[: len(ids)] if out.log_probs is not None else [0.0] * len(ids)
    if len(log_probs) != len(ids):
        raise ValueError(f"generate returned {len(log_probs)} log-probs for {len(ids)} tokens")
    traj.sampled_ids += ids
    traj.response_ids += ids
    traj.response_mask += [1] * len(ids)
    traj.rollout_log_probs += log_probs
    traj.token_versions += list(out.versions)[: len(ids)] if out.versions is not None else [-1] * len(ids)
    if len(traj.token_versions) != len(traj.response_ids):
        raise ValueError(f"generate returned {len(out.versions or [])} versions for {len(ids)} tokens")
    traj.assistant_turns += 1
    ended = bool(ids) and ids[-1] in stops
    text = tokenizer.decode(ids[:-1] if ended else ids)
    traj.messages.append({"role": "assistant", "content": text})
    if not ended:
        traj.turn_rewards.append(0.0)
        traj.reward_positions.append(max(len(traj.response_ids) - 1, 0))
        traj.stop_reason = "length"
    return text


def _step(env: Environment, text: str, label: str, env_name: str) -> StepResult:
    try:
        return env.step(text)
    except Exception as exc:
        raise RuntimeError(_env_failure(env, env_name, "step", label, exc)) from exc


def _env_failure(env: Environment, env_name: str, method: str, label: str, exc: Exception) -> str:
    name = env_name or type(env).__name__
    return f"environment {name!r} failed in {method}() on {label}: {type(exc).__name__}: {exc}"


def _apply_step(
    traj: Trajectory, result: StepResult, tokenizer: Any, stops: list[int], config: AgentLoopConfig
) -> None:
    traj.turn_rewards.append(float(result.reward))
    traj.reward_positions.append(len(traj.response_ids) - 1)
    traj.tool_calls += int(result.info.get("tool_calls", 0))
    if result.done:
        traj.stop_reason = "done"
    elif traj.assistant_turns >= config.max_assistant_turns:
        traj.stop_reason = "max_assistant_turns"
    elif traj.user_turns >= config.max_user_turns:
        traj.stop_reason = "max_user_turns"
    if traj.done:
        return
    ids = observation_ids(tokenizer, result.observations, stops, traj.tools)
    if len(traj.response_ids) + len(ids) >= config.response_length:  # no room left for a model token
        traj.stop_reason = "response_length"
        return
    traj.response_ids += ids
    traj.response_mask += [0] * len(ids)
    traj.rollout_log_probs += [0.0] * len(ids)
    traj.token_versions += [-1] * len(ids)
    traj.messages += result.observations
    traj.user_turns += 1
