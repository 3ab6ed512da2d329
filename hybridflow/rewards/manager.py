"""RewardManager: turn generated responses into token-level scores.

Given a batch with `responses`, `response_mask`, `data_source` and
`ground_truth`, it decodes each response's valid tokens, scores it with the
reward function (a rule scorer chosen by `data_source`, or a custom one) and
writes the score at the response's last valid token of a [B, R] tensor, zero
elsewhere (`hybridflow.protocol.keys.TOKEN_LEVEL_SCORES`). When the batch also holds
`rm_scores` from a reward-model worker, they are added to the rule scores.

A multi-turn batch (rollout.multi_turn, it holds `env_rewards`) is not scored by the rule function:
its token-level scores are the environment's per-turn rewards, each on the last token of its model
turn (the built-in "tool" environment's final reward is the row's rule score), plus `rm_scores` if
present (the reward model scores the whole trajectory at its last token, a model token); a row's
`scores` entry is the sum of its environment rewards.

A response with no valid token (empty mask) gets its score at column 0 so
that it is not lost from sequence-level sums.

A non-finite score (NaN, inf) from the reward function would poison the advantages and make every
later update skip: with `non_finite="error"` it raises `NonFiniteRewardError` naming the step, the row
(its batch position, data_source and dataset index) and the value; with "drop" the row's score becomes
0, `RewardResult.dropped` lists it (the trainer zeroes its response_mask after the parity guard, so it
trains nothing) and `reward/non_finite_dropped` counts it.
"""

from __future__ import annotations

import math
import multiprocessing
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.protocol import DataProto, keys
from hybridflow.rewards.registry import default_compute_score

RewardFn = Callable[..., float]


class NonFiniteRewardError(RuntimeError):
    """The reward function returned NaN or inf for a row (reward.non_finite=error); one-line message."""


@dataclass
class RewardResult:
    """What `RewardManager.__call__` returns."""

    token_level_scores: torch.Tensor
    """[B, R] float32: the score at each response's last valid token, plus rm_scores if present."""
    scores: list[float]
    """The rule (or custom) score of each response, in batch order."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Mean score per data_source (`reward/<source>/mean`) and overall (`reward/mean`)."""
    dropped: list[int] = field(default_factory=list)
    """Rows whose score was not finite, scored 0 (non_finite="drop"): the update must not train them."""


class RewardManager:
    """Scores a DataProto of responses with a per-sample reward function."""

    def __init__(
        self, tokenizer: Any, compute_score: RewardFn | None = None, num_workers: int = 0, non_finite: str = "error"
    ):
        """`compute_score(data_source, solution_str, ground_truth, extra_info)` defaults to
        the rule registry; `num_workers > 0` scores in that many processes (worth it only
        for slow scorers; the function must be importable by name). `non_finite`: "error" or "drop"
        (reward.non_finite; see the module docstring)."""
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.num_workers = num_workers
        self.non_finite = non_finite

    def __call__(self, data: DataProto) -> RewardResult:
        """Score every row of `data`; see the module docstring for the layout."""
        if keys.ENV_REWARDS in data.batch.keys():
            return self._environment_scores(data)
        responses = data.batch[keys.RESPONSES]
        lengths = data.batch[keys.RESPONSE_MASK].sum(-1).long()
        texts = self.tokenizer.batch_decode(
            [row[:n].tolist() for row, n in zip(responses, lengths)], skip_special_tokens=True
        )
        sources = [str(s) for s in data.non_tensor_batch[keys.DATA_SOURCE]]
        truths = [str(t) for t in data.non_tensor_batch[keys.GROUND_TRUTH]]
        extras = _column(data, keys.EXTRA_INFO)
        scores = self._score_all(list(zip(sources, texts, truths, extras)))
        dropped = self._non_finite(data, scores, sources)
        token_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = (lengths - 1).clamp(min=0)
        token_scores[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
        if keys.RM_SCORES in data.batch.keys():
            token_scores = token_scores + data.batch[keys.RM_SCORES].float()
        return RewardResult(token_scores, scores, _with_drops(source_metrics(sources, scores), dropped), dropped or [])

    def _non_finite(self, data: DataProto, scores: list[float], sources: list[str]) -> list[int] | None:
        """The rows with a NaN / inf score, their scores set to 0 (non_finite=drop; None: nothing to drop under
        non_finite=error), or NonFiniteRewardError naming the first (non_finite=error)."""
        bad = [i for i, score in enumerate(scores) if not math.isfinite(score)]
        if self.non_finite != "drop" and not bad:
            return None
        if self.non_finite != "drop":
            i, step = bad[0], data.meta_info.get(keys.META_GLOBAL_STEP)
            index = data.non_tensor_batch["index"][i] if "index" in data.non_tensor_batch else None
            raise NonFiniteRewardError(
                f"{'at step ' + str(step) if step is not None else 'in validation'}, the reward function returned "
                f"{scores[i]} for row {i} of the batch (data_source={sources[i]!r}, dataset index={index}; "
                f"{len(bad)} of {len(scores)} rows are non-finite): fix the reward function, or set "
                "reward.non_finite=drop to train without such rows"
            )
        for i in bad:
            scores[i] = 0.0
        return bad

    def _environment_scores(self, data: DataProto) -> RewardResult:
        """A multi-turn batch: the environment's per-turn rewards (+ rm_scores); a row's score is their sum."""
        token_scores = data.batch[keys.ENV_REWARDS].float()
        scores = token_scores.sum(-1).tolist()
        sources = [str(s) for s in data.non_tensor_batch[keys.DATA_SOURCE]]
        dropped = self._non_finite(data, scores, sources)
        token_scores = torch.nan_to_num(token_scores, nan=0.0, posinf=0.0, neginf=0.0)  # only dropped rows have any
        if keys.RM_SCORES in data.batch.keys():
            token_scores = token_scores + data.batch[keys.RM_SCORES].float()
        return RewardResult(token_scores, scores, _with_drops(source_metrics(sources, scores), dropped), dropped or [])

    def _score_all(self, items: list[tuple[str, str, str, Any]]) -> list[float]:
        if self.num_workers <= 0 or len(items) < 2:
            return [float(self.compute_score(*item)) for item in items]
        chunk = max(1, len(items) // (4 * self.num_workers))
        # fork: a custom reward module loaded from a file is importable only in a copy of this process.
        with ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return [float(s) for s in pool.map(_score_one, [self.compute_score] * len(items), items, chunksize=chunk)]


def _with_drops(metrics: dict[str, float], dropped: list[int] | None) -> dict[str, float]:
    return metrics if dropped is None else {**metrics, "reward/non_finite_dropped": float(len(dropped))}


def _score_one(fn: RewardFn, item: tuple[str, str, str, Any]) -> float:
    return fn(*item)


def _column(data: DataProto, key: str) -> list[Any]:
    if key in data.non_tensor_batch:
        return list(data.non_tensor_batch[key])
    return [None] * len(data)


def source_metrics(sources: list[str], scores: list[float]) -> dict[str, float]:
    """Mean score per data source and overall."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(sources, scores):
        by_source[source].append(score)
    metrics = {f"reward/{s}/mean": sum(v) / len(v) for s, v in sorted(by_source.items())}
    if scores:
        metrics["reward/mean"] = sum(scores) / len(scores)
    return metrics
