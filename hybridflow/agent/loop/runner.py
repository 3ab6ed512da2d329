"""The token-exact multi-turn agent loop over a rollout's turn engine (or any "generate one turn for a batch" function).

`run_agent_loop(rows, env_factory, generate, tokenizer, config)` runs one trajectory per row, all of them
together. `generate` is a `TurnEngine` or a plain `GenerateFn` (run as one by `BatchTurns`):
- the loop submits each trajectory's next turn to the engine (its key and its whole context: the prompt and
  everything appended so far) and calls `advance` while turns are pending, which returns the turns that ended;
- each ended turn's text goes to its environment's `step` in a thread pool, and the loop goes on decoding the
  others while the tool runs; when the step returns, its observation is appended and the trajectory's next turn
  is submitted. With a continuous engine (`TurnEngine.continuous`: the native rollout's, which keeps each
  trajectory's KV cache and lets trajectories join and leave its running batch) a slow tool delays only its own
  trajectory. With a round engine (`BatchTurns`, every `GenerateFn`) the loop waits for every step in flight
  before the next `advance`, so each call generates a whole round as before.

A trajectory is kept as token ids exactly as sampled:
- model tokens are appended as `generate` returned them (never decoded and re-encoded),
  with `response_mask` 1 and their sampling log-probs;
- observation tokens are the template's rendering of the observation messages, tokenized
  once (`tokens.observation_ids`), with `response_mask` 0 and log-prob 0.
A trajectory's next context is always its last one plus the turn's ids plus the observation ids, so an engine
that keeps the previous context's cache needs to run only the new tokens.

A trajectory stops when the environment says done ("done"), after `max_assistant_turns`
model turns or `max_user_turns` observation turns, when a turn ends without a stop token
(the per-turn or total budget ran out: "length"), or when the next observation would not fit
in `response_length` ("response_length"; the observation is then not appended). Per-turn
rewards sit on the last token of their model turn (`reward_positions`).

`generate(batch, max_new_tokens)` (a `GenerateFn`) gets one list of token ids per trajectory of the round and one
new-token limit per row, and returns one `TurnOutput` per row: the sampled ids, including the stop token when it
stopped on one, and their log-probs (or None).

An environment that raises fails the loop with one line naming the environment, the row and
the error.

`times` (a `LoopTimes`, optional) gets the call's wall time split into the engine's calls, waiting on the
environments with nothing to decode (`reset`, and the steps the loop had to wait for) and the rest (decoding
turns, tokenizing observations), and the summed duration of every environment step (`tool_s`, which overlaps
the rest); `LoopTimes.metrics()` gives them as `agent/*` metrics. A few clock reads per turn, so they are always
taken.

Departures from verl's `ToolAgentLoop`: one loop over an engine instead of one asyncio task per trajectory (the
overlap of a trajectory's tool call with the others' decoding is the same); `response_length` counts model and
observation tokens alike (as verl's), while `max_turn_tokens` caps one turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class TurnEngine(Protocol):
    """A rollout's multi-turn session (what `Rollout.turn_generator` may give instead of a `GenerateFn`): turns of
    trajectories, each named by a key, generated as they are submitted."""

    continuous: bool
    """True: `advance` may be called while other trajectories' tools run, and a turn's samples do not depend on
    which other turns share its batch (the loop then overlaps tools with decoding); False: the loop submits a
    whole round, waits for it and for its tool calls, then the next round."""

    def submit(self, key: int, context: list[int], budget: int) -> None:
        """Queue trajectory `key`'s next turn: `context` is its whole conversation so far, at most `budget` new
        tokens, stopping at the rollout's EOS ids. A key's next context extends its last one by the turn's ids
        and the observation's, so an engine may keep the last one's cache and run only the new tokens."""

    def advance(self) -> list[tuple[int, TurnOutput]]:
        """Generate; return the turns that ended (key, turn), maybe none, each submitted turn exactly once."""

    def release(self, key: int) -> None:
        """Trajectory `key` has ended: whatever the engine keeps for it may go."""


class BatchTurns:
    """A `GenerateFn` as a round `TurnEngine`: `advance` generates every submitted turn in one call, in key order."""

    continuous = False

    def __init__(self, generate: GenerateFn) -> None:
        self.generate = generate
        self.queued: dict[int, tuple[list[int], int]] = {}

    def submit(self, key: int, context: list[int], budget: int) -> None:
        """See `TurnEngine.submit`."""
        self.queued[key] = (context, budget)

    def advance(self) -> list[tuple[int, TurnOutput]]:
        """See `TurnEngine.advance`: one `generate` call on every queued turn."""
        keys = sorted(self.queued)
        batch = [self.queued.pop(k) for k in keys]
        outputs = self.generate([context for context, _ in batch], [budget for _, budget in batch])
        if len(outputs) != len(keys):
            raise ValueError(f"generate returned {len(outputs)} turns for {len(keys)} rows")
        return list(zip(keys, outputs))

    def release(self, key: int) -> None:
        """See `TurnEngine.release` (nothing is kept)."""


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
    """Waiting on environments with nothing to generate: their `reset` calls, and the `step` calls (run
    concurrently, tool calls among them) the loop had to wait for."""
    total_s: float = 0.0
    """The whole call (generate, environments, and the loop's own decoding and tokenizing)."""
    rounds: int = 0
    """Generate calls (`TurnEngine.advance` calls; one per round for a round engine)."""
    tool_s: float = 0.0
    """The summed duration of every environment `step` (where tools run), overlapping decoding and each other."""

    def metrics(self, prefix: str = "agent") -> dict[str, float]:
        """`{prefix}/generate_time_s`, `/env_time_s`, `/loop_time_s`, `/rounds`, `/env_time_share`
        (env_s / total_s: the share of the loop spent waiting on environments and tools) and `/tool_time_s`."""
        return {
            f"{prefix}/generate_time_s": self.generate_s,
            f"{prefix}/env_time_s": self.env_s,
            f"{prefix}/loop_time_s": self.total_s,
            f"{prefix}/rounds": float(self.rounds),
            f"{prefix}/env_time_share": self.env_s / self.total_s if self.total_s > 0 else 0.0,
            f"{prefix}/tool_time_s": self.tool_s,
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
    generate: GenerateFn | TurnEngine,
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
    engine = generate if isinstance(generate, TurnEngine) else BatchTurns(generate)
    envs = [env_factory() for _ in rows]
    trajs = [_start(i, row, env, tokenizer, env_name, labels[i], clock) for i, (row, env) in enumerate(zip(rows, envs))]
    budgets: dict[int, int] = {}  # the pending turn's budget of each trajectory waiting on the engine

    def submit(traj: Trajectory) -> None:
        budgets[traj.row_index] = min(config.max_turn_tokens, config.response_length - len(traj.response_ids))
        engine.submit(traj.row_index, traj.prompt_ids + traj.response_ids, budgets[traj.row_index])

    def step(traj: Trajectory, text: str) -> tuple[StepResult, float]:
        start = time.perf_counter()
        result = _step(envs[traj.row_index], text, labels[traj.row_index], env_name)
        return result, time.perf_counter() - start

    for traj in trajs:
        submit(traj)
    stepping: dict[Future, Trajectory] = {}  # environment steps in flight
    with ThreadPoolExecutor(max_workers=config.max_parallel_steps) as pool:
        while budgets or stepping:
            if budgets and (engine.continuous or not stepping):
                start = time.perf_counter()
                turns = engine.advance()
                clock.generate_s += time.perf_counter() - start
                clock.rounds += 1
                for key, out in turns:
                    traj = trajs[key]
                    text = _append_turn(traj, out, budgets.pop(key), stops, tokenizer)
                    if traj.done:
                        engine.release(key)
                    else:
                        stepping[pool.submit(step, traj, text)] = traj
                ready = [f for f in stepping if f.done()]
            else:  # nothing to generate until a step returns
                start = time.perf_counter()
                ready = list(wait(stepping, return_when=FIRST_COMPLETED).done)
                clock.env_s += time.perf_counter() - start
            for future in sorted(ready, key=lambda f: stepping[f].row_index):
                traj = stepping.pop(future)
                result, seconds = future.result()
                clock.tool_s += seconds
                _apply_step(traj, result, tokenizer, stops, config)
                if traj.done:
                    engine.release(traj.row_index)
                else:
                    submit(traj)
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
