"""Harness calls and their recorded sessions -> one generated batch, in the in-process agent loop's layout.

Row i of the batch is harness call i (prompt row i // n, sample i % n), in the order of the prompt rows
repeated n times, with every non-tensor column of the prompts repeated with it, so the n trajectories of a
row share its uid (one GRPO group). The layout is `batch.trajectories_to_batch`'s: the trajectory's first
prompt (messages and tool schemas as the endpoint rendered them) left-padded to the prompt batch's width,
model tokens with `response_mask` 1 and their sampling log-probs, the template tokens of the messages the
harness added (tool results, user turns) with `response_mask` 0, and the reward under `env_rewards` on the
last model token, which the reward step uses instead of the rule scorer (rewards/manager.py).

Which trajectory: a session holds one trajectory, or several when the harness edited its history
(`on_mismatch=split`) or asked for n > 1; the last one recorded is trained (the one its final answer was
generated in), the others are not.

A response longer than rollout.response_length is cut to it (`stop_reason` "response_length"; the reward
then sits on the last model token kept). A first prompt wider than the prompt batch fails the step: the
fix is a larger data.max_prompt_length.

A dropped call (`harness_status` "error": it raised, "timeout", "empty": no request recorded, "bad_reward":
it returned neither a finite number nor None) keeps its row, so the batch keeps its size (prompt rows x n,
which the trainer already made divisible by the data-parallel size) and its order: the row holds the
dataset prompt and an empty response (`response_mask` all 0: no loss, no gradient, in no loss normaliser),
reward 0, `stop_reason` "dropped", and a uid of its own (`<uid>/dropped/<i>`), so that its 0 does not
enter the group statistics of the row's trajectories that ran (GRPO, RLOO: a group of one gets advantage 0
or its own score, which its empty mask never trains on).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridflow.agent.loop.batch import trajectories_to_batch
from hybridflow.agent.loop.runner import Trajectory
from hybridflow.endpoint.sessions import message_text
from hybridflow.protocol import DataProto, keys
from hybridflow.rewards import default_compute_score

DROPPED = "dropped"
"""`stop_reason` of a dropped call's row."""


def harness_batch(
    prompts: DataProto,
    rows: Sequence[dict[str, Any]],
    outcomes: Sequence[Any],
    recorded: Sequence[list[Trajectory]],
    pad_id: int,
    response_length: int,
) -> DataProto:
    """The batch of `len(rows)` harness calls (module docstring); `outcomes[i]` is call i's `harness.Outcome`
    and `recorded[i]` its session's trajectories."""
    n = len(rows) // len(prompts)
    width = prompts.batch[keys.INPUT_IDS].shape[1]
    trajs, statuses = [], []
    for i, (row, outcome, session) in enumerate(zip(rows, outcomes, recorded)):
        traj, status = trained_trajectory(row, outcome, session, i // n)
        if traj is None:
            traj = placeholder(prompts, i // n)
        elif len(traj.prompt_ids) > width:
            raise ValueError(
                f"rollout.agent: the harness's first request renders a prompt of {len(traj.prompt_ids)} tokens "
                f"(messages and tool schemas), wider than the prompt batch ({width}); raise data.max_prompt_length"
            )
        trajs.append(cut(traj, response_length))
        statuses.append(status)
    out = trajectories_to_batch(trajs, pad_id, width, response_length)
    out.batch[keys.ENV_REWARDS] = out.batch.pop(keys.TOKEN_LEVEL_SCORES)
    for key, column in prompts.non_tensor_batch.items():
        out.non_tensor_batch[key] = np.repeat(column, n, axis=0)
    if keys.UID in out.non_tensor_batch:
        uids = out.non_tensor_batch[keys.UID]
        for i, status in enumerate(statuses):
            if status != "ok":
                uids[i] = f"{uids[i]}/{DROPPED}/{i}"
    out.non_tensor_batch[keys.HARNESS_STATUS] = np.array(statuses, dtype=object)
    out.meta_info.update(prompts.meta_info)
    return out


def trained_trajectory(
    row: dict[str, Any], outcome: Any, session: list[Trajectory], row_index: int
) -> tuple[Trajectory | None, str]:
    """(the session's last trajectory with its reward, "ok"), or (None, why it is dropped)."""
    if outcome.status != "ok":
        return None, outcome.status
    if not session or not any(session[-1].response_mask):
        return None, "empty"
    value = outcome.value
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    ):
        return None, "bad_reward"
    traj = session[-1]
    traj.row_index = row_index
    traj.turn_rewards = [float(value) if value is not None else score_last_answer(row, traj)]
    return traj, "ok"


def score_last_answer(row: dict[str, Any], traj: Trajectory) -> float:
    """The row's rule score of the text of the trajectory's last assistant message."""
    answers = [m for m in traj.messages if m.get("role") == "assistant"]
    text = message_text(answers[-1].get("content")) if answers else ""
    truth = row["reward_model"]["ground_truth"]
    return float(default_compute_score(row["data_source"], text, truth, row.get("extra_info")))


def placeholder(prompts: DataProto, index: int) -> Trajectory:
    """A dropped call's row: the dataset prompt, no response, no reward."""
    ids = prompts.batch[keys.INPUT_IDS][index][prompts.batch[keys.ATTENTION_MASK][index].bool()]
    return Trajectory(index, ids.tolist(), [], [], stop_reason=DROPPED)


def cut(traj: Trajectory, width: int) -> Trajectory:
    """`traj` with its response cut to `width` tokens (its sampled ids to the model tokens kept) and its one
    reward on its last model token kept."""
    if len(traj.response_ids) > width:
        traj.response_ids, traj.response_mask = traj.response_ids[:width], traj.response_mask[:width]
        traj.rollout_log_probs = traj.rollout_log_probs[:width]
        traj.token_versions = traj.token_versions[:width]
        traj.sampled_ids = traj.sampled_ids[: sum(traj.response_mask)]
        traj.stop_reason = "response_length"
    model = [k for k, m in enumerate(traj.response_mask) if m]
    traj.reward_positions = model[-1:]
    traj.turn_rewards = traj.turn_rewards[-1:] if model else []
    return traj
