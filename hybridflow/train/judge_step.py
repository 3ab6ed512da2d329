"""The judge's part of a training step, on the controller: one call over every row, verdicts into rewards.

`judge_rewards` decodes the responses, sends every row to the judge worker group in one call (each worker generates
its share of verdicts in one generate call), scores rows without a verdict judge.invalid_score, and combines:
judge.combine="replace" makes the judge's score the reward (the rule score is only compared with it), "add" adds it
to the rule (or custom) score. Both land on the response's last valid token, where the rule score lies.

Metrics (per step):
- judge/score_mean: the mean judge score of the batch, invalid_score included;
- judge/invalid, judge/overlong, judge/failed: rows with an unparseable verdict, with a judge prompt over
  judge.rollout.prompt_length, or without a verdict (the template raised on the row, or the judge's generate call
  failed or timed out);
- judge/yes_rate: of the rows with a verdict, the fraction scored >= 0.5;
- judge/rule_agreement: of the rows with a verdict, the fraction where the judge (score >= 0.5) and the rule
  score (>= 0.5) agree on pass / fail.
A worker process that dies is not scored: it fails the call like any worker failure (trainer.max_restarts).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridflow.controller.worker_group import WorkerGroup
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rewards.judge import question_of
from hybridflow.rewards.manager import RewardResult
from hybridflow.workers.judge import ERROR, QUESTION, RESPONSE, SCORES, STATUS, STATUSES, VERDICTS
from hybridflow.workers.judge_config import JudgeConfig

log = logging.getLogger(__name__)

PASS = 0.5
"""A score at or above it is a pass, for judge/yes_rate and judge/rule_agreement."""


def judge_inputs(batch: DataProto, tokenizer: Any) -> DataProto:
    """The texts a judge call needs, one row per response: question, decoded response, ground truth, extra_info."""
    responses = batch.batch[K.RESPONSES]
    lengths = batch.batch[K.RESPONSE_MASK].sum(-1).long().tolist()
    texts = tokenizer.batch_decode([row[:n].tolist() for row, n in zip(responses, lengths)], skip_special_tokens=True)
    nt = batch.non_tensor_batch
    columns = {
        QUESTION: [question_of(p) for p in nt[K.RAW_PROMPT]],
        RESPONSE: texts,
        K.GROUND_TRUTH: [str(t) for t in nt[K.GROUND_TRUTH]],
    }
    if K.EXTRA_INFO in nt:
        columns[K.EXTRA_INFO] = list(nt[K.EXTRA_INFO])
    return DataProto.from_dict({"judge_row": torch.arange(len(batch))}, non_tensors=columns)


def judge_rewards(
    group: WorkerGroup, batch: DataProto, tokenizer: Any, reward: RewardResult, cfg: JudgeConfig
) -> tuple[RewardResult, dict[str, float], list[str]]:
    """`reward` with the judge's scores combined into its token-level scores (see the module docstring), the
    step's judge/* metrics, and the verdicts (batch order)."""
    out = group.judge(judge_inputs(batch, tokenizer))
    if out.meta_info.get(ERROR):
        log.warning("judge: %s; its rows are scored judge.invalid_score=%s", out.meta_info[ERROR], cfg.invalid_score)
    status = out.batch[STATUSES].long()
    ok = status == STATUS["ok"]
    scores = torch.where(ok, out.batch[SCORES].float(), torch.full_like(out.batch[SCORES], cfg.invalid_score))
    rule = torch.tensor(reward.scores, dtype=torch.float32)
    token_scores = reward.token_level_scores.clone()
    last = (batch.batch[K.RESPONSE_MASK].sum(-1).long() - 1).clamp(min=0)
    rows = torch.arange(len(batch))
    token_scores[rows, last] += scores - rule if cfg.combine == "replace" else scores
    metrics = judge_metrics(scores, status, rule)
    return (
        RewardResult(token_scores, reward.scores, {**reward.metrics, **metrics}, reward.dropped),
        metrics,
        [str(v) for v in out.non_tensor_batch[VERDICTS]],
    )


def judge_metrics(scores: torch.Tensor, status: torch.Tensor, rule: torch.Tensor) -> dict[str, float]:
    """The judge/* metrics of one step (module docstring)."""
    ok = status == STATUS["ok"]
    metrics = {"judge/score_mean": float(scores.mean()) if len(scores) else 0.0}
    metrics.update({f"judge/{name}": float((status == code).sum()) for name, code in STATUS.items() if name != "ok"})
    if ok.any():
        judge_pass, rule_pass = scores[ok] >= PASS, rule[ok] >= PASS
        metrics["judge/yes_rate"] = float(judge_pass.float().mean())
        metrics["judge/rule_agreement"] = float((judge_pass == rule_pass).float().mean())
    return metrics
