"""Validation: generate on the held-out prompts with rollout.val_kwargs and score them.

Reports, per data_source, mean@n (mean score over all n responses of every prompt)
and pass@n (share of prompts with at least one correct response) as
`val-core/<data_source>/acc/mean@<n>` and `val-core/<data_source>/acc/pass@<n>`; multi-turn
rollouts also report `val-aux/agent/turns/mean`, `val-aux/agent/tool_call_rate` (share of trajectories
with a tool call), `val-aux/agent/tool_calls/mean` and the stop reasons.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.train.core_steps import pass_at_n
from hybridflow.train.metrics import agent_metrics


def validate(actor_rollout: Any, val_loader: Any, reward_fn: Any, n: int) -> dict[str, float]:
    """Generate and score every validation prompt once; returns the val-core metrics."""
    sources, uids, scores, outs = [], [], [], []
    for i, prompts in enumerate(val_loader):
        prompts.non_tensor_batch[K.UID] = np.array([f"val-{i}-{j}" for j in range(len(prompts))], dtype=object)
        out = actor_rollout.generate_sequences(prompts, validate=True)
        out.meta_info.pop(K.META_METRICS, None)
        result = reward_fn(out)
        sources += [str(s) for s in out.non_tensor_batch[K.DATA_SOURCE]]
        # the prompts' uids: a harness row dropped in generation has a uid of its own (endpoint/harness_batch.py)
        uids += [u for u in prompts.non_tensor_batch[K.UID] for _ in range(len(out) // len(prompts))]
        scores += result.scores
        outs.append(out)
    metrics = summarize_scores(sources, uids, scores, n)
    if outs and K.NUM_TURNS in outs[0].non_tensor_batch:  # multi-turn: tool-call rate, turns per trajectory
        metrics.update(agent_metrics(DataProto.concat(outs), prefix="val-aux/agent"))
    return metrics


def summarize_scores(
    sources: list[str], uids: list, scores: list[float], n: int, prefix: str = "val-core"
) -> dict[str, float]:
    """`<prefix>/<data_source>/acc/mean@n` and `.../pass@n` from per-response scores."""
    by_source: dict[str, list[int]] = defaultdict(list)
    for idx, source in enumerate(sources):
        by_source[source].append(idx)
    metrics = {}
    for source, idx in sorted(by_source.items()):
        s = np.asarray(scores, dtype=np.float64)[idx]
        metrics[f"{prefix}/{source}/acc/mean@{n}"] = float(s.mean())
        metrics[f"{prefix}/{source}/acc/pass@{n}"] = pass_at_n(np.asarray(uids, dtype=object)[idx], s)
    return metrics
