"""The generation backend of the OpenAI-compatible server, and the batcher in front of it.

A backend turns a batch of `GenerationRequest`s (prompt token ids + that request's sampling
params) into `n` `Sample`s per request (sampled ids + their log-probs), in one call:

    backend.generate(requests: list[GenerationRequest]) -> list[list[Sample]]

It stops a sample at `max_tokens` or at the first id in `stop_ids` (kept as the sample's last
id). Stop *strings* are cut afterwards for every backend alike by `cut_at_stop` (the kept ids
are a prefix of the sampled ones, so nothing is re-tokenized). `rollout_backend.py` adapts a
native/hf `Rollout`; tests use scripted backends.

`Batcher` runs one backend on one thread: a request submitted while a generation runs waits
for it and goes into the next batch together with every other request that arrived meanwhile;
an idle batcher waits `max_wait_s` after the first request for more (up to `max_batch`).
A request cancelled while it waits (its future cancelled: the client left or timed out) is dropped
before it costs a generation. One already generating is marked abandoned (`Batcher.abandon`): once every
request of the batch is, or the batcher closes, the generation is interrupted, if the backend has an
`interrupted` event (`RolloutBackend`: `ModuleRollout.interrupted`), and its rows end after the current
decode step; without one, the batch runs to its end. A backend call that
raises is retried on each half of its batch, down to single requests, so the exception reaches only
the request(s) that cause it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and the sampling params of the HTTP request it came from."""

    prompt_ids: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    """Ids that end a sample besides the backend's EOS ids (the server passes the stop strings that are
    one token); the stop id is kept in the sample."""


@dataclass
class Sample:
    """One sampled continuation."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str = "length"
    """"stop" when it ended on a stop id or stop string, else "length"."""
    stopped_on_id: bool = False
    """True when the last id is one of the backend's `stop_ids` (EOS: an end of turn the chat template
    also writes); False after `max_tokens`, an extra stop id or a stop string."""
    extra: dict[str, Any] = field(default_factory=dict)


class GenerationBackend(Protocol):
    """What the server needs from a model (module docstring)."""

    max_tokens: int
    """Most new tokens one sample may have; requests asking more are clamped to it."""
    stop_ids: tuple[int, ...]
    """The ids that always end a sample (the model's EOS ids)."""
    max_model_len: int | None
    """Most prompt + new tokens the model takes (None: no limit known)."""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """`request.n` samples per request, in order."""
        ...


def cut_at_stop(tokenizer: Any, sample: Sample, stop_strings: Sequence[str]) -> tuple[Sample, str]:
    """(the sample cut after the first token that completes a stop string, its text without the stop
    string and without a final stop id). Without a stop string in the text the sample is unchanged."""
    ids = sample.token_ids[:-1] if sample.stopped_on_id else sample.token_ids
    text = tokenizer.decode(ids)
    hits = [(text.find(s), s) for s in stop_strings if s and s in text]
    if not hits:
        return sample, text
    start, stop = min(hits)
    keep = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    cut = Sample(ids[:keep], sample.log_probs[:keep], "stop", False, sample.extra)
    return cut, text[:start]


class BatcherClosed(RuntimeError):
    """The batcher was closed (the server is stopping) before the request was generated."""


class _Job:
    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.future: Future[list[Sample]] = Future()
        self.abandoned = False


class Batcher:
    """One thread that feeds a backend batches of concurrent requests (module docstring)."""

    def __init__(self, backend: GenerationBackend, max_wait_s: float = 0.005, max_batch: int = 64) -> None:
        self.backend = backend
        self.max_wait_s = max_wait_s
        self.max_batch = max_batch
        self.batch_sizes: list[int] = []
        """Requests per backend call, in call order (for metrics and tests)."""
        self.dropped = 0
        """Requests cancelled before their generation started (never generated)."""
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = threading.Event()
        self._interrupt: threading.Event | None = getattr(backend, "interrupted", None)  # optional (module docstring)
        self._lock = threading.Lock()
        self._current: list[_Job] = []
        self._thread = threading.Thread(target=self._run, name="hybridflow-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future[list[Sample]]:
        """Queue one request; the future gets its `n` samples, or the exception of the backend call that
        included it alone (module docstring); cancelling the future before its batch starts drops it."""
        job = _Job(request)
        if self._closed.is_set():
            job.future.set_exception(BatcherClosed("the server is stopping"))
        else:
            self._queue.put(job)
        return job.future

    def abandon(self, future: Future[list[Sample]]) -> None:
        """Nobody waits for `future` any more: drop its request if queued, else mark it abandoned and interrupt the
        generation once every request of its batch is (module docstring)."""
        if future.cancel():
            return
        with self._lock:
            for job in self._current:
                job.abandoned = job.abandoned or job.future is future
            if self._current and all(job.abandoned for job in self._current) and self._interrupt is not None:
                self._interrupt.set()

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (about: cancelled ones are counted until the thread reaches them)."""
        return self._queue.qsize()

    @property
    def running(self) -> bool:
        """Whether the thread still runs (after `close`: a generation it did not wait for)."""
        return self._thread.is_alive()

    def close(self, timeout_s: float = 60.0) -> None:
        """Fail every queued request (`BatcherClosed`) and stop the thread after the batch in flight, waiting
        at most `timeout_s` for it (the thread is a daemon: a process may exit while it generates)."""
        self._closed.set()
        with self._lock:
            if self._current and self._interrupt is not None:
                self._interrupt.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(BatcherClosed("the server is stopping"))
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while (batch := self._collect()) is not None:
            if batch:
                self.batch_sizes.append(len(batch))
                try:
                    self._serve(batch)
                finally:
                    with self._lock:
                        self._current = []
                        if self._interrupt is not None:
                            self._interrupt.clear()

    def _collect(self) -> list[_Job] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        waited = False
        while len(batch) < self.max_batch:
            try:  # what queued up during the last generation first, then a short wait for stragglers
                job = self._queue.get_nowait() if not waited else self._queue.get(timeout=self.max_wait_s)
            except queue.Empty:
                if waited:
                    break
                waited = True
                continue
            if job is None:
                self._queue.put(None)  # close after this batch
                break
            batch.append(job)
        with self._lock:  # from here a job is not cancellable, only abandoned: `abandon` must find it in `_current`
            live = [job for job in batch if job.future.set_running_or_notify_cancel()]
            self._current = live
        self.dropped += len(batch) - len(live)
        return live

    def _serve(self, batch: list[_Job]) -> None:
        try:
            outputs = self.backend.generate([job.request for job in batch])
            if len(outputs) != len(batch):
                raise RuntimeError(f"the backend returned {len(outputs)} results for {len(batch)} requests")
        except Exception as exc:  # find the request(s) that fail: halves, down to one; the thread lives on
            if len(batch) == 1:
                batch[0].future.set_exception(exc)
                return
            half = len(batch) // 2
            self._serve(batch[:half])
            self._serve(batch[half:])
            return
        for job, samples in zip(batch, outputs):
            job.future.set_result(samples)
