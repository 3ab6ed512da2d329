"""Trajectories of the agent loop -> one DataProto in the layout of hybridflow/protocol/keys.py.

Prompts are left-padded, responses right-padded, as every rollout backend returns them. What
differs from a single-turn rollout:
- `response_mask` is 1 on model tokens only; observation tokens inside the response are 0
  (not trained), while `attention_mask` is 1 on every real token, observations included
  (they are context the model attended to);
- `token_level_scores` holds each model turn's reward on that turn's last token (a
  single-turn rollout has one score, on the last valid token); their row sum is the
  trajectory's reward;
- `sampled_ids_hash` is the hash of the concatenation of each model turn's sampled ids (`Trajectory.sampled_ids`),
  not of the assembled response, so the trainer's token parity check sees any trained token the model did not sample;
- `token_policy_version` holds the policy version that sampled each model token (-1 elsewhere);
- non-tensor columns `num_turns` (model turns), `tool_calls` and `stop_reason` per row, for metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridflow.agent.loop.runner import Trajectory
from hybridflow.protocol import DataProto, keys
from hybridflow.protocol.token_hash import hash_list_rows


def _pad(rows: list[list], width: int, value: float, left: bool, dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), width] of `value` with each row's values at the right (left-padded) or left end."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            values = torch.tensor(row, dtype=dtype)
            if left:
                out[i, width - len(row) :] = values
            else:
                out[i, : len(row)] = values
    return out


def trajectories_to_batch(
    trajs: Sequence[Trajectory], pad_id: int, prompt_length: int | None = None, response_length: int | None = None
) -> DataProto:
    """Stack trajectories into a DataProto (module docstring); widths default to the longest row.

    A prompt longer than `prompt_length` or a response longer than `response_length` raises.
    """
    p_width = prompt_length or max(len(t.prompt_ids) for t in trajs)
    r_width = response_length or max(max(len(t.response_ids) for t in trajs), 1)
    for t in trajs:
        if len(t.prompt_ids) > p_width or len(t.response_ids) > r_width:
            raise ValueError(
                f"trajectory of row {t.row_index}: {len(t.prompt_ids)} prompt / {len(t.response_ids)} response "
                f"tokens exceed the widths {p_width} / {r_width}"
            )
    prompts = _pad([t.prompt_ids for t in trajs], p_width, pad_id, True, torch.long)
    prompt_mask = _pad([[1] * len(t.prompt_ids) for t in trajs], p_width, 0, True, torch.long)
    responses = _pad([t.response_ids for t in trajs], r_width, pad_id, False, torch.long)
    valid = _pad([[1] * len(t.response_ids) for t in trajs], r_width, 0, False, torch.long)
    attention = torch.cat([prompt_mask, valid], dim=1)
    scores = torch.zeros(len(trajs), r_width, dtype=torch.float32)
    for i, t in enumerate(trajs):
        for position, reward in zip(t.reward_positions, t.turn_rewards):
            scores[i, position] += reward
    tensors = {
        keys.PROMPTS: prompts,
        keys.RESPONSES: responses,
        keys.RESPONSE_MASK: _pad([t.response_mask for t in trajs], r_width, 0, False, torch.long),
        keys.INPUT_IDS: torch.cat([prompts, responses], dim=1),
        keys.ATTENTION_MASK: attention,
        keys.POSITION_IDS: (attention.cumsum(-1) - 1).clamp(min=0),
        keys.ROLLOUT_LOG_PROBS: _pad([t.rollout_log_probs for t in trajs], r_width, 0.0, False, torch.float32),
        keys.TOKEN_LEVEL_SCORES: scores,
        keys.SAMPLED_IDS_HASH: hash_list_rows([t.sampled_ids for t in trajs]),
        keys.TOKEN_POLICY_VERSION: _pad([t.token_versions for t in trajs], r_width, -1, False, torch.long),
    }
    non_tensors = {
        keys.NUM_TURNS: np.array([t.assistant_turns for t in trajs]),
        keys.TOOL_CALLS: np.array([t.tool_calls for t in trajs]),
        keys.STOP_REASON: np.array([t.stop_reason for t in trajs], dtype=object),
    }
    return DataProto.from_dict(tensors, non_tensors)
