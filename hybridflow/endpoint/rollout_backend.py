"""A native/hf `Rollout` as the server's generation backend (`backend.GenerationBackend`).

One `generate_sequences` call per distinct sampling setting among the batch's requests, with
every request's prompt repeated `n` times (n=1 per row) and the response width set to the
group's largest `max_tokens`; each sample is then cut at its own `max_tokens` and at the first
of its extra `stop_ids` (the rollout itself stops at its EOS ids). Log-probs are the rollout's
(`rollout/sampling.py`: the temperature-scaled, unfiltered distribution).

With `backend.sampling` set (a trainer serving a harness, hybridflow/endpoint/harness.py) every request is
sampled with those params instead of its own temperature / top_p, so that the recorded log-probs are
taken at the temperature the trainer computes its log-probs at.

Not thread-safe (it swaps `rollout.config` per call): the server's `Batcher` calls it from one thread.
This is the one place that knows `generate_sequences`' input (left-padded DataProto and
`SamplingParams`) and output (hybridflow/protocol/keys.py).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from hybridflow.endpoint.backend import GenerationRequest, Sample
from hybridflow.models import load_tokenizer
from hybridflow.protocol.keys import (
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from hybridflow.rollout.backends import build_rollout
from hybridflow.rollout.base import ModuleRollout, left_padded
from hybridflow.rollout.config import RolloutConfig, SamplingParams


class RolloutBackend:
    """`GenerationBackend` over an in-process `ModuleRollout` (module docstring)."""

    def __init__(self, rollout: ModuleRollout) -> None:
        if not rollout.config.calculate_log_probs:
            rollout.config = dataclasses.replace(rollout.config, calculate_log_probs=True)
        self.rollout = rollout
        self.max_tokens = int(rollout.config.response_length)
        self.stop_ids = tuple(rollout.eos_ids)
        self.max_model_len = getattr(rollout.model.config, "max_position_embeddings", None)
        self.interrupted = rollout.interrupted
        """Set: the generation in progress ends after its current step (backend.py: `Batcher.abandon`)."""
        self.sampling: SamplingParams | None = None
        """When set (with n=1), the params of every request, overriding the request's (module docstring)."""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        """See `GenerationBackend.generate`."""
        out: list[list[Sample]] = [[] for _ in requests]
        groups: dict[SamplingParams, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(self._sampling_of(req), []).append(i)
        for sampling, members in groups.items():
            rows = [requests[i] for i in members for _ in range(requests[i].n)]
            samples = iter(self._generate(rows, sampling))
            for i in members:
                out[i] = [next(samples) for _ in range(requests[i].n)]
        return out

    def _sampling_of(self, req: GenerationRequest) -> SamplingParams:
        if self.sampling is not None:
            return self.sampling
        greedy = req.temperature <= 0  # OpenAI's temperature 0; the rollout's temperature must stay > 0
        temperature = self.rollout.config.temperature if greedy else req.temperature
        return SamplingParams(temperature=temperature, top_p=req.top_p, do_sample=not greedy, n=1)

    def _generate(self, rows: list[GenerationRequest], sampling: SamplingParams) -> list[Sample]:
        base = self.rollout.config
        width = max(min(r.max_tokens, self.max_tokens) for r in rows)
        self.rollout.config = dataclasses.replace(base, response_length=width, prompt_length=_widest(rows, base))
        try:
            result = self.rollout.generate_sequences(
                left_padded([r.prompt_ids for r in rows], self.rollout.pad_id), sampling
            )
        finally:
            self.rollout.config = base
        ids, mask, logps = (result.batch[k] for k in (RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS))
        return [_sample(r, ids[i], mask[i], logps[i], self.stop_ids) for i, r in enumerate(rows)]


def _widest(rows: list[GenerationRequest], config: RolloutConfig) -> int:
    return max(max(len(r.prompt_ids) for r in rows), config.prompt_length or 1)


def _sample(
    req: GenerationRequest, ids: torch.Tensor, mask: torch.Tensor, logps: torch.Tensor, eos: tuple[int, ...]
) -> Sample:
    length = min(int(mask.sum()), req.max_tokens)
    tokens, values = ids[:length].tolist(), logps[:length].tolist()
    stops = set(eos) | set(req.stop_ids)
    end = next((k + 1 for k, t in enumerate(tokens) if t in stops), None)
    if end is None:
        return Sample(tokens, values, "length", False)
    return Sample(tokens[:end], values[:end], "stop", tokens[end - 1] in eos)


def load_rollout_backend(
    model_path: str | os.PathLike, max_tokens: int = 512, dtype: str = "fp32", seed: int = 0, name: str = "native"
) -> RolloutBackend:
    """A backend over a `name` rollout ("native" or "hf") of the HF model directory `model_path`,
    sampling at most `max_tokens` new tokens per sample."""

    config = RolloutConfig(
        name=name, response_length=max_tokens, prompt_length=None, dtype=dtype, seed=seed, calculate_log_probs=True
    )
    rollout = build_rollout(config, model_path, load_tokenizer(model_path))
    if not isinstance(rollout, ModuleRollout):
        raise ValueError(f"the server runs in-process rollouts (native, hf), not {name!r}")
    return RolloutBackend(rollout)
