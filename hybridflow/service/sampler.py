"""Sampling for the Tinker API: hybridflow's native rollout over one inference copy of the base model.

A sampler snapshot is an adapter (the LoRA tensors of a client at save time and their scaling), never a
model copy. Sampling from a snapshot merges it into the inference copy's adapted layers (W + s * B @ A from
the base weights), unless that snapshot is already loaded; sampling the base model restores those layers.
Every load is checked twice, and a failed check fails the sample with a server error:
- the parity guard's weight fingerprints (hybridflow/parity/fingerprint.py): what the rollout holds must be
  bit-identical to what was merged;
- log-prob parity (hybridflow/parity/logprob.py): the inference copy's log-probs of a fixed probe text must equal
  the training forward's at save time within the guard's bounds for the native rollout in fp32
  (`DEFAULT_THRESHOLDS`), so that a wrong merge, scaling or base never samples silently.

`prompt_logprobs` (what the SDK's compute_logprobs asks for) come from one teacher-forced forward of the same
inference copy: the log-prob of each prompt token given those before it, NaN at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from hybridflow.endpoint.backend import GenerationRequest
from hybridflow.endpoint.rollout_backend import RolloutBackend, load_rollout_backend
from hybridflow.parity.config import DEFAULT_THRESHOLDS
from hybridflow.parity.fingerprint import differing, fingerprints
from hybridflow.parity.logprob import logprob_gaps
from hybridflow.rollout.config import SamplingParams
from hybridflow.service.errors import ServerError, UserError
from hybridflow.service.wire import Sequence


@dataclass(frozen=True)
class Snapshot:
    """Frozen adapter weights a sampler samples from (`key` names it: its tinker path or session id), and the
    training forward's log-probs of the parity probe at save time."""

    key: str
    state: dict[str, Tensor]
    scaling: float
    probe_logprobs: np.ndarray | None = None


@dataclass
class SampleArgs:
    """One asample request's prompt and sampling params."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    prompt_logprobs: bool = False


class Sampler:
    """The inference copy, its rollout and which snapshot it holds (module docstring)."""

    def __init__(
        self, path: str | Path, max_tokens: int, vocab_size: int, context_length: int, merge, probe: np.ndarray
    ) -> None:
        self.backend: RolloutBackend = load_rollout_backend(path, max_tokens=max_tokens, dtype="fp32")
        self.tokenizer = self.backend.rollout.tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self._merge = merge
        self._probe = probe
        self._held = self.backend.rollout.held_weights()
        self._base: dict[str, Tensor] = {}
        """Originals of the layers a snapshot has overwritten (restored for the base model)."""
        self.loaded: str | None = None

    def load(self, snapshot: Snapshot | None) -> None:
        """Make the rollout hold `snapshot` merged into the base (None: the base model itself)."""
        key = None if snapshot is None else snapshot.key
        if key == self.loaded and snapshot is not None:
            return
        merged = {} if snapshot is None else self._merge(snapshot.state, snapshot.scaling)
        for name in merged:
            if name not in self._base:
                self._base[name] = self._held[name].detach().clone()
        weights = {name: base for name, base in self._base.items() if name not in merged} | merged
        if weights:
            self.backend.rollout.load_weights(weights, partial=True)
            wrong = differing(fingerprints(weights), fingerprints(self._held, weights))
            if wrong:
                self.loaded = "?"
                raise ServerError(f"the sampler's weights differ from the snapshot's after loading: {wrong[:3]}")
        if snapshot is not None and snapshot.probe_logprobs is not None:
            self.loaded = "?"
            self._check_probe(snapshot)
        self.loaded = key

    def _check_probe(self, snapshot: Snapshot) -> None:
        bounds = DEFAULT_THRESHOLDS[("native", "fp32")]
        mine = torch.from_numpy(self._prompt_logprobs(self._probe.tolist())[1:])[None]
        theirs = torch.from_numpy(np.asarray(snapshot.probe_logprobs, dtype=np.float32))[None]
        if mine.shape != theirs.shape:
            raise ServerError(f"snapshot {snapshot.key}'s parity probe was taken on another tokenizer's probe")
        gaps = logprob_gaps(theirs, mine, torch.ones_like(mine), bounds.ratio)
        if gaps.gap_mean > bounds.gap_mean or gaps.gap_max > bounds.gap_max:
            raise ServerError(
                f"log-prob parity breach on snapshot {snapshot.key}: the sampler's log-probs of the probe differ from "
                f"the training forward's by {gaps.gap_mean:.2e} nats on average (bound {bounds.gap_mean:.0e}), "
                f"{gaps.gap_max:.2e} at most (bound {bounds.gap_max:.0e}); the snapshot is not sampled"
            )

    def sample(self, batch: list[SampleArgs]) -> list[tuple[list[Sequence], np.ndarray | None]]:
        """Each request's `num_samples` continuations and, when asked, its prompt log-probs, from one generate
        call: the requests must share their sampling params (`batch_key`); a seed is honoured for a batch of one."""
        first = batch[0]
        if first.seed is not None:
            self.backend.rollout.generator.manual_seed(first.seed)
        greedy = first.temperature <= 0
        self.backend.sampling = SamplingParams(
            temperature=1.0 if greedy else first.temperature, top_p=first.top_p, top_k=first.top_k, do_sample=not greedy
        )
        requests = [GenerationRequest(a.prompt, a.max_tokens, a.num_samples, stop_ids=a.stop_ids) for a in batch]
        try:
            samples = self.backend.generate(requests)
        finally:
            self.backend.sampling = None
        return [
            (
                [self._sequence(s.token_ids, s.log_probs, s.finish_reason, a) for s in per_request],
                self._prompt_logprobs(a.prompt) if a.prompt_logprobs else None,
            )
            for a, per_request in zip(batch, samples, strict=True)
        ]

    def check(self, args: SampleArgs) -> None:
        """Raise UserError for a request the sampler cannot serve (before it joins a batch)."""
        if not args.prompt:
            raise UserError("the prompt is empty")
        bad = [t for t in args.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"the prompt holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if len(args.prompt) + args.max_tokens > self.context_length:
            raise UserError(
                f"prompt ({len(args.prompt)} tokens) + max_tokens ({args.max_tokens}) exceed the model's context "
                f"of {self.context_length}"
            )
        if args.max_tokens > self.backend.max_tokens:
            raise UserError(
                f"max_tokens={args.max_tokens} is more than this service samples ({self.backend.max_tokens}); ask "
                "fewer, or restart `hybridflow tinker` with a larger --max-tokens"
            )
        if args.num_samples < 1 or args.max_tokens < 1:
            raise UserError(f"num_samples and max_tokens must be >= 1 (got {args.num_samples}, {args.max_tokens})")

    def _sequence(self, tokens: list[int], logps: list[float], reason: str, args: SampleArgs) -> Sequence:
        if reason != "stop" and args.stop_strings:
            for k in range(1, len(tokens) + 1):  # the first prefix whose text holds a stop string ends it
                if any(s in self.tokenizer.decode(tokens[:k]) for s in args.stop_strings):
                    return Sequence(tokens[:k], logps[:k], "stop")
        return Sequence(tokens, logps, reason)

    @torch.inference_mode()
    def _prompt_logprobs(self, prompt: list[int]) -> np.ndarray:
        ids = torch.tensor([prompt])
        logits = self.backend.rollout.model(input_ids=ids).logits[0].float()
        logp = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return np.concatenate([[np.nan], logp.numpy()]).astype(np.float32)
