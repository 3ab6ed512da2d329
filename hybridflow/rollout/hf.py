"""hf rollout: transformers `generate`, post-processed into the rollout layout.

The reference backend: simple and general, slower than `native`. Temperature,
top-k and top-p run as transformers' own logits warpers, passed explicitly
after a recorder that keeps log softmax(logits / temperature) of each step
(before filtering, as in `sampling.py`) and gathers it at the token the next
step reveals, so log-probs cost [B, V] of memory instead of [B, R, V].
Sampling is seeded from the rollout's generator through a forked global RNG.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import Tensor
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hybridflow.protocol.token_hash import hash_rows
from hybridflow.rollout.base import ModuleRollout
from hybridflow.rollout.config import SamplingParams
from hybridflow.rollout.layout import pad_responses, response_mask_from_tokens


class _LogProbRecorder(LogitsProcessor):
    """Records the log-prob of each sampled token under softmax(scores / temperature)."""

    def __init__(self, temperature: float, prompt_width: int) -> None:
        self.temperature = temperature
        self.prompt_width = prompt_width
        self.prev: Tensor | None = None
        self.steps: list[Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.gather(input_ids)
        self.prev = (scores.float() / self.temperature).log_softmax(dim=-1)
        return scores

    def gather(self, input_ids: Tensor) -> None:
        """Turn the pending step's distribution into the log-prob of the token it produced."""
        if self.prev is not None and input_ids.shape[1] > self.prompt_width + len(self.steps):
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.prev = None


class _Interrupted(StoppingCriteria):
    """Ends every row once `event` is set (`ModuleRollout.interrupted`)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class HFRollout(ModuleRollout):
    """Generation with `model.generate` (see module docstring)."""

    def _generate(
        self, ids: Tensor, mask: Tensor, pos: Tensor, params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        width, prompt_width = self.config.response_length, ids.shape[1]
        recorder = _LogProbRecorder(params.temperature if params.do_sample else 1.0, prompt_width)
        processors = LogitsProcessorList([recorder, *self._warpers(params)])
        seed = int(torch.randint(2**31 - 1, (1,), generator=self.generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            seqs = self.model.generate(
                ids,
                attention_mask=mask,
                generation_config=self._generation_config(params),
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([_Interrupted(self.interrupted)]),
            )
        recorder.gather(seqs)
        responses = pad_responses(seqs[:, prompt_width:], width, self.pad_id)
        valid = torch.zeros_like(responses, dtype=torch.bool)
        valid[:, : seqs.shape[1] - prompt_width] = True
        eos = torch.tensor([] if self.config.ignore_eos else self.eos_ids, dtype=torch.long)
        resp_mask = response_mask_from_tokens(responses, eos, valid)
        sampled = hash_rows(seqs[:, prompt_width:], resp_mask[:, : seqs.shape[1] - prompt_width])  # as generated
        responses = responses.masked_fill(resp_mask == 0, self.pad_id)
        log_probs = torch.zeros(responses.shape, dtype=torch.float32)
        if recorder.steps:
            log_probs[:, : len(recorder.steps)] = torch.stack(recorder.steps, dim=1)
        return responses, resp_mask, log_probs * resp_mask, sampled

    def _generation_config(self, params: SamplingParams):
        gc = copy.deepcopy(self.model.generation_config)
        # sampling warpers come in through logits_processor (after the recorder), so neutralise the defaults
        gc.update(
            do_sample=params.do_sample,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=self.config.response_length,
            num_return_sequences=params.n,
            pad_token_id=self.pad_id,
            eos_token_id=None if self.config.ignore_eos else self.eos_ids,
        )
        return gc

    @staticmethod
    def _warpers(params: SamplingParams) -> list[LogitsProcessor]:
        if not params.do_sample:
            return []
        warpers: list[LogitsProcessor] = []
        if params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        return warpers
