"""Training an agent harness: plain `openai`-client code run against the worker's own rollout (rollout.agent).

The harness is a user function, named by `rollout.agent.function` (`module:name` or `file.py:name`, loaded in
the rollout worker's process):

    run(client: openai.OpenAI, row: dict) -> float | None

- `client` points at this worker's OpenAI-compatible endpoint (hybridflow/endpoint/app.py) and carries a
  session id of its own (the `x-session-id` header), fresh for every call: every request the harness makes
  through it is recorded as one trajectory, token by token as sampled (hybridflow/endpoint/sessions.py).
- `row` is a copy of the verl-format dataset row, as the in-process agent loop gets it
  (`rollout/multi_turn.py` `dataset_rows`): `prompt` (chat messages), `data_source`, `reward_model.ground_truth`,
  `extra_info` (the tools a row offers in `extra_info.tools`, as the dataset stores them).
- It returns the trajectory's reward, or None to have the row's rule scorer
  (`hybridflow.rewards.default_compute_score`) score the text content of the last assistant message.

`HarnessRunner` (one per rollout worker, built on its first generate call and kept for the run) serves the
worker's in-process rollout on 127.0.0.1 (a free port), so requests are generated with the current policy
weights (the worker syncs them into that rollout before each step). Each generate call runs the harness once
per prompt row x `sampling.n`, at most `rollout.agent.max_concurrency` at once on daemon threads, and turns the
recorded sessions into the batch (harness_batch.py). Every request is sampled with the call's sampling params
(rollout.temperature / top_p / top_k, or rollout.val_kwargs in validation), whatever temperature or top_p the
harness asks for: the trainer compares its log-probs with the recorded ones at that temperature; `max_tokens`,
`stop`, `tools` and `n` are the harness's.

A harness that raises, returns something other than a finite number or None, makes no request, or runs past
`rollout.agent.timeout_s` costs its trajectory only (harness_batch.py says how a dropped one is kept). A call
past its timeout is abandoned, not killed (Python cannot stop a thread): its thread runs on, and the endpoint
answers its later requests with an error once the step's generation is over.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.agent.config import AgentConfig
from hybridflow.endpoint.app import SESSION_HEADER, AgentServer, ServerConfig, start_server
from hybridflow.endpoint.backend import GenerationRequest, Sample
from hybridflow.endpoint.harness_batch import harness_batch
from hybridflow.endpoint.limits import ServerLimits
from hybridflow.endpoint.rollout_backend import RolloutBackend
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import ModuleRollout
from hybridflow.rollout.config import SamplingParams
from hybridflow.rollout.multi_turn import dataset_rows
from hybridflow.utils.plugins import load_object

logger = logging.getLogger(__name__)
SERVER_COUNTERS = ("sessions/requests", "sessions/split", "sessions/refused")
"""The endpoint's counters reported per step (as `endpoint/<name>`, per rollout worker)."""
HARNESS_KEY = "hybridflow"
"""The bearer token of the harness's client (its sessions belong to it: server.py `session_owner`)."""


def harness_limits(config: AgentConfig) -> ServerLimits:
    """The endpoint's bounds for a harness run: requests time out with their harness call, and the queue holds
    what `max_concurrency` calls can have in flight (a few requests each) with room to spare."""
    return ServerLimits(
        request_timeout_s=config.timeout_s, max_queued=max(ServerLimits.max_queued, 8 * config.max_concurrency)
    )


@dataclass
class Outcome:
    """How one harness call ended."""

    status: str
    """"ok", "error" (it raised) or "timeout"."""
    value: Any = None
    """What it returned ("ok" only)."""
    error: str = ""


class StepGate:
    """A generation backend that generates only while a rollout step runs (abandoned harness calls get errors)."""

    def __init__(self, backend: RolloutBackend) -> None:
        self.backend = backend
        self.max_tokens, self.stop_ids, self.max_model_len = backend.max_tokens, backend.stop_ids, backend.max_model_len
        self.interrupted = backend.interrupted
        self.open = False

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """The backend's samples; raises outside a step."""
        if not self.open:
            raise RuntimeError("no rollout step is running: this harness call was dropped after its timeout")
        return self.backend.generate(requests)


class HarnessRunner:
    """The endpoint over one worker's rollout and the harness calls of each generate call (module docstring)."""

    def __init__(self, rollout: ModuleRollout, config: AgentConfig, response_length: int) -> None:
        import openai  # noqa: PLC0415  (only harness runs need the client; the config checks it is installed)

        if not isinstance(rollout, ModuleRollout):
            raise TypeError(f"rollout.agent needs an in-process rollout (native, hf), got {type(rollout).__name__}")
        self.fn: Callable[[Any, dict[str, Any]], Any] = load_object(config.function, "rollout.agent.function")
        self.config, self.rollout, self.response_length = config, rollout, response_length
        self.backend = RolloutBackend(rollout)
        self.gate = StepGate(self.backend)
        limits = harness_limits(config)
        self.server = AgentServer(
            self.gate, rollout.tokenizer, ServerConfig(on_mismatch=config.on_mismatch, limits=limits)
        )
        self.running = start_server(self.server, "127.0.0.1", 0)
        self.client = openai.OpenAI(
            base_url=self.running.url, api_key=HARNESS_KEY, max_retries=0, timeout=config.timeout_s
        )

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> tuple[DataProto, dict[str, float]]:
        """`sampling.n` harness trajectories per prompt row as one generated batch (harness_batch.py), and the
        endpoint's counters of this call (`endpoint/requests`, `.../split`, `.../refused`)."""
        rows = dataset_rows(prompts, sampling.n)
        sessions = [uuid.uuid4().hex for _ in rows]
        self.server.sessions.pop_all()  # what calls abandoned in an earlier step recorded since
        before = self.server.metrics()
        self.backend.sampling = dataclasses.replace(sampling, n=1)
        self.gate.open = True
        try:
            calls = [self._call(row, sid) for row, sid in zip(rows, sessions)]
            outcomes = run_calls(calls, self.config.max_concurrency, self.config.timeout_s)
        finally:
            self.gate.open = False
        recorded = [self.server.pop_session(sid, HARNESS_KEY, i // sampling.n) for i, sid in enumerate(sessions)]
        after = self.server.metrics()
        out = harness_batch(prompts, rows, outcomes, recorded, self.rollout.pad_id, self.response_length)
        return out, {f"endpoint/{k.split('/')[-1]}": after[k] - before[k] for k in SERVER_COUNTERS}

    def _call(self, row: dict[str, Any], session_id: str) -> Callable[[], Any]:
        client = self.client.with_options(default_headers={SESSION_HEADER: session_id})
        row = copy.deepcopy(row)
        return lambda: self.fn(client, row)

    def close(self) -> None:
        """Stop the endpoint and close the client."""
        self.running.stop()
        self.client.close()


def run_calls(calls: Sequence[Callable[[], Any]], max_concurrency: int, timeout_s: float) -> list[Outcome]:
    """Run every call on a daemon thread of its own, at most `max_concurrency` at once, each for at most
    `timeout_s` seconds from its start; a call past it is abandoned (its slot freed) as "timeout"."""
    results: dict[int, Outcome] = {}
    done: queue.Queue[tuple[int, Outcome]] = queue.Queue()
    deadlines: dict[int, float] = {}
    started = 0
    while started < len(calls) or deadlines:
        while started < len(calls) and len(deadlines) < max_concurrency:
            thread = threading.Thread(target=_run_one, args=(calls[started], started, done), daemon=True)
            thread.name = f"hybridflow-harness-{started}"
            thread.start()
            deadlines[started] = time.monotonic() + timeout_s
            started += 1
        try:
            index, outcome = done.get(timeout=max(min(deadlines.values()) - time.monotonic(), 0.0))
            if deadlines.pop(index, None) is not None:  # else it finished after its timeout: already counted
                results[index] = outcome
        except queue.Empty:
            pass
        now = time.monotonic()
        for index in [i for i, deadline in deadlines.items() if deadline <= now]:
            del deadlines[index]
            results[index] = Outcome("timeout", error=f"still running after {timeout_s} s")
    return [results[i] for i in range(len(calls))]


def _run_one(call: Callable[[], Any], index: int, done: queue.Queue) -> None:
    try:
        done.put((index, Outcome("ok", call())))
    except Exception as err:  # a harness bug costs its trajectory, never the run
        logger.warning("harness call %d raised", index, exc_info=True)
        done.put((index, Outcome("error", error=f"{type(err).__name__}: {err}")))
