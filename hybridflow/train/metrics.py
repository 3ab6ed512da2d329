"""Per-step metrics under verl's names (critic/score/mean, response_length/mean, perf/throughput, ...)."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def data_metrics(batch: DataProto, response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one training batch."""
    b = batch.batch
    mask = b[K.RESPONSE_MASK].bool()  # trained tokens: multi-turn observation tokens are 0
    resp_len = b[K.ATTENTION_MASK][:, -mask.shape[1] :].sum(-1).float()  # every real token after the prompt
    prompt_len = b[K.ATTENTION_MASK][:, : b[K.PROMPTS].shape[1]].sum(-1).float()
    metrics = {
        **_stats("critic/score", b[K.TOKEN_LEVEL_SCORES].sum(-1)),
        **_stats("critic/rewards", b[K.TOKEN_LEVEL_REWARDS].sum(-1)),
        **_stats("critic/advantages", b[K.ADVANTAGES][mask]),
        **_stats("critic/returns", b[K.RETURNS][mask]),
        **_stats("response_length", resp_len),
        **_stats("prompt_length", prompt_len),
        "response_length/clip_ratio": float((resp_len >= response_length).float().mean()),
    }
    if K.VALUES in b.keys():
        metrics.update(_stats("critic/values", b[K.VALUES][mask]))
    if K.RM_SCORES in b.keys():  # the reward model's share of critic/score
        metrics.update(_stats("reward_model/score", b[K.RM_SCORES].sum(-1)))
    return {**metrics, **agent_metrics(batch)}


def agent_metrics(batch: DataProto, prefix: str = "agent") -> dict[str, float]:
    """Multi-turn rollouts (rows with num_turns): turns, tool calls, model-token share and the share of
    trajectories per stop reason (`agent/stop_reason/<reason>`); {} for single-turn batches."""
    columns = batch.non_tensor_batch
    if K.NUM_TURNS not in columns:
        return {}
    turns = columns[K.NUM_TURNS].astype(float)
    calls = columns[K.TOOL_CALLS].astype(float)
    reasons = [str(r) for r in columns[K.STOP_REASON]]
    model = batch.batch[K.RESPONSE_MASK].sum(-1).float()
    metrics = {
        f"{prefix}/turns/mean": float(turns.mean()),
        f"{prefix}/turns/max": float(turns.max()),
        f"{prefix}/tool_calls/mean": float(calls.mean()),
        f"{prefix}/tool_call_rate": float((calls > 0).mean()),
        f"{prefix}/model_tokens/mean": float(model.mean()),
    }
    for reason in sorted(set(reasons)):
        metrics[f"{prefix}/stop_reason/{reason}"] = reasons.count(reason) / len(reasons)
    return {**metrics, **harness_metrics(batch, prefix)}


def harness_metrics(batch: DataProto, prefix: str = "agent") -> dict[str, float]:
    """Harness rollouts (rows with harness_status, hybridflow/endpoint/harness_batch.py): how many calls of the
    batch raised (`harness_errors`), ran past rollout.agent.timeout_s (`harness_timeouts`), recorded no request
    (`harness_empty`), returned a bad reward (`harness_bad_rewards`), and all dropped rows (`harness_dropped`)."""
    if K.HARNESS_STATUS not in batch.non_tensor_batch:
        return {}
    statuses = [str(s) for s in batch.non_tensor_batch[K.HARNESS_STATUS]]
    names = {"error": "errors", "timeout": "timeouts", "empty": "empty", "bad_reward": "bad_rewards"}
    metrics = {f"{prefix}/harness_{name}": float(statuses.count(status)) for status, name in names.items()}
    metrics[f"{prefix}/harness_dropped"] = float(sum(s != "ok" for s in statuses))
    return metrics


def throughput_metrics(batch: DataProto, timing: dict[str, float], n_workers: int) -> dict[str, float]:
    """Tokens processed per second per worker over the whole step."""
    tokens = float(batch.batch[K.ATTENTION_MASK].sum())
    step = timing.get("step", 0.0)
    metrics = {"perf/total_num_tokens": tokens, "perf/time_per_step": step}
    if step > 0:
        metrics["perf/throughput"] = tokens / (step * n_workers)
    gen = timing.get("gen", 0.0)
    if gen > 0:
        metrics["perf/gen_tokens_per_s"] = float(batch.batch[K.RESPONSE_MASK].sum()) / gen
    return metrics


def worker_metrics(*outputs: DataProto) -> dict[str, Any]:
    """meta_info["metrics"] of worker outputs, lists averaged into one float each (memory/* peaks: the max)."""
    merged: dict[str, float] = {}
    for out in outputs:
        for key, value in out.meta_info.get(K.META_METRICS, {}).items():
            values = value if isinstance(value, list) else [value]
            if key.startswith("memory/"):  # a peak: the largest worker's is the one that must fit
                merged[key] = max(merged.get(key, float("-inf")), *map(float, values)) if values else 0.0
            else:
                merged[key] = float(sum(values) / len(values)) if values else 0.0
    return merged
