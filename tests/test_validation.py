"""Validation summaries: mean@n and pass@n per data_source, checked against hand-computed values."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.train.core_steps import pass_at_n
from hybridflow.train.validation import summarize_scores, validate

N = 3
# Per prompt: (data_source, scores of its N responses). pass@n needs a score > 0.5.
PROMPTS = [
    ("arith", [1.0, 0.0, 0.0]),  # passes
    ("gsm8k", [0.0, 0.0, 0.0]),  # fails
    ("arith", [0.5, 0.5, 0.0]),  # fails: 0.5 is not > 0.5
    ("gsm8k", [1.0, 1.0, 0.0]),  # passes
    ("gsm8k", [1.0, 1.0, 1.0]),  # passes
]
EXPECTED = {
    "val-core/arith/acc/mean@3": (1 + 0.5 + 0.5) / 6,
    "val-core/arith/acc/pass@3": 1 / 2,
    "val-core/gsm8k/acc/mean@3": (0 + 2 + 3) / 9,
    "val-core/gsm8k/acc/pass@3": 2 / 3,
}


def test_pass_at_n_counts_prompts_with_a_response_above_one_half():
    uids = np.array(["a", "a", "a", "b", "b", "b", "c", "c", "c"], dtype=object)
    scores = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.5, 0.2, 0.6, 0.0, 0.0])
    assert pass_at_n(uids, scores) == pytest.approx(2 / 3)  # a (1.0) and c (0.6); b's best is 0.5
    assert pass_at_n(uids, scores.numpy()) == pytest.approx(2 / 3)  # summarize_scores passes numpy
    assert pass_at_n(uids[:3], torch.tensor([-1.0, -2.0, -0.5])) == 0.0
    assert pass_at_n(np.array([], dtype=object), torch.tensor([])) == 0.0


def test_summarize_scores_per_data_source():
    sources = [src for src, s in PROMPTS for _ in s]
    uids = [f"p{i}" for i, (_, s) in enumerate(PROMPTS) for _ in s]
    scores = [x for _, s in PROMPTS for x in s]
    metrics = summarize_scores(sources, uids, scores, N)
    assert metrics.keys() == EXPECTED.keys()
    for key, value in EXPECTED.items():
        assert metrics[key] == pytest.approx(value), key
    assert set(summarize_scores(sources, uids, scores, N, prefix="val-aux")) == {
        k.replace("val-core", "val-aux") for k in EXPECTED
    }


class FakeRollout:
    """generate_sequences: N copies of every prompt (interleaved, as the rollout does), with a sample index."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def generate_sequences(self, prompts: DataProto, **kwargs) -> DataProto:
        self.calls.append(kwargs)
        out = prompts.repeat(N, interleave=True)
        out.batch["sample"] = torch.arange(len(out)) % N
        out.meta_info[K.META_METRICS] = {"timing/gen": 1.0}
        return out


def _score(data: DataProto) -> SimpleNamespace:
    """Look every response's score up in PROMPTS by (prompt id, sample index)."""
    pid, sample = data.batch["pid"].tolist(), data.batch["sample"].tolist()
    assert K.META_METRICS not in data.meta_info  # validate drops the rollout's metrics first
    return SimpleNamespace(scores=[PROMPTS[p][1][k] for p, k in zip(pid, sample)])


def _loader() -> list[DataProto]:
    """Two batches (3 + 2 prompts): uid "index in batch" alone would merge prompts 1 and 4."""
    batches = []
    for lo, hi in ((0, 3), (3, 5)):
        batches.append(
            DataProto.from_dict(
                {"pid": torch.arange(lo, hi)},
                {K.DATA_SOURCE: np.array([PROMPTS[i][0] for i in range(lo, hi)], dtype=object)},
            )
        )
    return batches


def test_validate_generates_scores_and_summarizes_every_batch():
    rollout = FakeRollout()
    metrics = validate(rollout, _loader(), _score, N)
    assert len(rollout.calls) == 2 and all(c == {"validate": True} for c in rollout.calls)
    assert metrics.keys() == EXPECTED.keys()
    for key, value in EXPECTED.items():
        assert metrics[key] == pytest.approx(value), key
