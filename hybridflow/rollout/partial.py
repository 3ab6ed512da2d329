"""Policy versions of sampled tokens, and partial rollout (trainer.partial_rollout): a generation that takes a
weight push in the middle and goes on under the new weights.

Both wrap what `Rollout.turn_generator` gives the agent loop (agent/loop/runner.py):
- `versioned(generate, version)`: every turn's ids stamped with the policy version the rollout held when the
  round was generated (`TurnOutput.versions`), so each trajectory carries the version of every token; a
  `TurnEngine` (the native rollout's, rollout/native/turns.py) is stamped as each `advance` returns its turns;
- `resumable(generate, stops, interrupt, take_push, version)`, on the round path (`turn_generator(...,
  interruptible=True)`: a turn engine's decoder keeps the weights it was built with): before each call it takes a push that was
  announced meanwhile (`take_push`: receive and load the weights, return True); a call cut short by `interrupt`
  (set by a `PushWatch` when the actor announces a push: the rollout ends its rows after the current decode step,
  `ModuleRollout.interrupted`) takes the push, then continues each cut row from its context plus the ids sampled
  so far, up to the rest of its budget. A row's turn is thus the ids sampled under each version in order, every
  id stamped with the version that sampled it and keeping the log-prob the sampler drew it with: the trained ids
  are the sampled ids, and a token's rollout log-prob is its own version's.

The continuation re-reads the row's context under the new weights (the KV cache of the old ones is not reused, as
slime's and AReaL's resumed requests re-prefill), and its sampler draws are not those an uninterrupted call would
have made.

`generate_turnwise(rollout, prompts, sampling, wrap)`: single-turn rows generated through the (wrapped) turn
generator instead of `generate_sequences`, in the same output layout, so that partial rollout covers them too: each
prompt's context repeated `sampling.n` times, one turn of up to rollout.response_length tokens each, stopped at the
rollout's EOS ids. Its prefill runs once per sample rather than once per prompt.

`PushWatch(poll, held, interrupt)`: a thread that, while a generation runs, polls `poll()` (the step of the last
announced push, rollout/bridge.py `announced`, over a store connection of its own) and sets `interrupt` as long
as it is newer than `held()`. The generation's thread clears it when it takes the push (or finds none), so a
spurious set costs one decode step.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridflow.agent.loop.runner import GenerateFn, TurnEngine, TurnOutput
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.protocol.token_hash import hash_list_rows
from hybridflow.rollout.config import SamplingParams
from hybridflow.rollout.layout import build_output

POLL_S = 0.01
"""How often a `PushWatch` asks the store for an announced push (a loopback round trip each)."""


def versioned(generate: GenerateFn | TurnEngine, version: Callable[[], int]) -> GenerateFn | TurnEngine:
    """`generate` with each turn's ids stamped with `version()` as it was when the round was generated."""
    if isinstance(generate, TurnEngine):
        return VersionedTurns(generate, version)

    def call(batch: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        held = version()
        outs = generate(batch, budgets)
        return [TurnOutput(o.token_ids, o.log_probs, [held] * len(o.token_ids)) for o in outs]

    return call


class VersionedTurns:
    """A `TurnEngine` whose turns carry `version()` as it was when `advance` returned them (the weights do not change
    while an engine runs: partial rollout takes the round path)."""

    def __init__(self, engine: TurnEngine, version: Callable[[], int]) -> None:
        self.engine, self.version = engine, version
        self.continuous = engine.continuous

    def submit(self, key: int, context: list[int], budget: int) -> None:
        """See `TurnEngine.submit`."""
        self.engine.submit(key, context, budget)

    def advance(self) -> list[tuple[int, TurnOutput]]:
        """See `TurnEngine.advance`: the engine's turns, each id stamped with the version held."""
        held = self.version()
        return [
            (key, TurnOutput(o.token_ids, o.log_probs, [held] * len(o.token_ids))) for key, o in self.engine.advance()
        ]

    def release(self, key: int) -> None:
        """See `TurnEngine.release`."""
        self.engine.release(key)


def resumable(
    generate: GenerateFn,
    stop_ids: Sequence[int],
    interrupt: threading.Event,
    take_push: Callable[[], bool],
    version: Callable[[], int],
) -> GenerateFn:
    """`generate` taking announced pushes before each call and continuing rows an interrupt cut (module docstring)."""
    stops = set(stop_ids)

    def call(batch: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        ids: list[list[int]] = [[] for _ in batch]
        logps: list[list[float]] = [[] for _ in batch]
        versions: list[list[int]] = [[] for _ in batch]
        todo = list(range(len(batch)))
        while todo:
            take_push()
            held = version()
            outs = generate([batch[i] + ids[i] for i in todo], [budgets[i] - len(ids[i]) for i in todo])
            cut = interrupt.is_set()
            for i, out in zip(todo, outs):
                new = list(out.token_ids)
                ids[i] += new
                logps[i] += list(out.log_probs)[: len(new)] if out.log_probs is not None else [0.0] * len(new)
                versions[i] += [held] * len(new)
            if not cut:
                break
            todo = [i for i in todo if len(ids[i]) < budgets[i] and not (ids[i] and ids[i][-1] in stops)]
        return [TurnOutput(ids[i], logps[i], versions[i]) for i in range(len(batch))]

    return call


def generate_turnwise(
    rollout: Any, prompts: DataProto, sampling: SamplingParams, wrap: Callable[[GenerateFn], GenerateFn]
) -> DataProto:
    """`sampling.n` samples per prompt row of an in-process rollout (`ModuleRollout`: config, pad_id, turn
    generator) through `wrap` of its turn generator, in `build_output`'s layout plus keys.TOKEN_POLICY_VERSION."""
    ids, mask, pos = (prompts.batch[k] for k in (K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS))
    contexts = [row[m.bool()].tolist() for row, m in zip(ids, mask) for _ in range(sampling.n)]
    width = rollout.config.response_length
    with rollout.turn_generator(dataclasses.replace(sampling, n=1), interruptible=True) as generate:
        outs = wrap(generate)(contexts, [width] * len(contexts))
    rows = len(outs)
    responses = torch.full((rows, width), rollout.pad_id, dtype=torch.long)
    response_mask = torch.zeros(rows, width, dtype=torch.long)
    log_probs = torch.zeros(rows, width)
    versions = torch.full((rows, width), -1, dtype=torch.long)
    for i, out in enumerate(outs):
        n = len(out.token_ids)
        responses[i, :n] = torch.tensor(out.token_ids, dtype=torch.long)
        response_mask[i, :n] = 1
        log_probs[i, :n] = torch.tensor(out.log_probs or [0.0] * n)
        versions[i, :n] = torch.tensor(out.versions or [-1] * n, dtype=torch.long)
    kept = log_probs if rollout.config.calculate_log_probs else None
    sampled = hash_list_rows([out.token_ids for out in outs])
    result = build_output(prompts, ids, mask, pos, responses, response_mask, sampling.n, kept, sampled)
    result.batch[K.TOKEN_POLICY_VERSION] = versions
    return result


def fill_versions(batch: DataProto, version: int) -> None:
    """Give `version` to every model token (response_mask 1) of `batch` that has no policy version yet (-1, or no
    keys.TOKEN_POLICY_VERSION at all): rows generated under one version throughout."""
    mask = batch.batch[K.RESPONSE_MASK].bool()
    versions = batch.batch[K.TOKEN_POLICY_VERSION] if K.TOKEN_POLICY_VERSION in batch.batch.keys() else None
    if versions is None:
        versions = torch.full(mask.shape, -1, dtype=torch.long)
    batch.batch[K.TOKEN_POLICY_VERSION] = torch.where(mask & (versions < 0), version, versions)


class PushWatch:
    """Sets `interrupt` while a push newer than the held weights is announced (module docstring); a context
    manager: the thread runs inside the `with` block."""

    def __init__(
        self,
        poll: Callable[[], int | None],
        held: Callable[[], int],
        interrupt: threading.Event,
        period_s: float = POLL_S,
    ) -> None:
        self.poll, self.held, self.interrupt, self.period_s = poll, held, interrupt, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="push-watch", daemon=True)

    def __enter__(self) -> PushWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.interrupt.clear()  # a push announced after the generation's last call: the worker's next call takes it

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            step = self.poll()
            if step is not None and step > self.held():
                self.interrupt.set()
