"""The agent loop inside the rollout worker: prompt rows in, multi-turn trajectories out (rollout.multi_turn).

`generate_multi_turn(rollout, prompts, sampling, config)` is what the worker's `generate_sequences` runs
when `rollout.multi_turn.enable`:
- every prompt row is repeated `sampling.n` times (non-tensor columns, uids included, repeated with it,
  so GRPO groups form over the trajectories of one row), and rebuilt as a verl-format row (`prompt`,
  `data_source`, `reward_model.ground_truth`, `extra_info`) from the columns RLDataset puts in the batch;
- one environment per trajectory comes from `ENVIRONMENTS` (a name or a `module:Class` path, loaded in
  this process, so a plugin environment works on Ray workers);
- `run_agent_loop` generates the trajectories' turns through the rollout's own `Rollout.turn_generator` (the
  interface's multi-turn capability, so a plugin rollout gets the loop by implementing it): native, where its
  fused decode step covers the model: the turn engine (rollout/native/turns.py: each trajectory's KV cache kept
  across turns, trajectories joining and leaving one running batch while tools run); hf and native elsewhere
  (`ModuleRollout`): per round one `generate_sequences` call on left-padded ids with the largest turn budget as
  response length, each row cut at its own; vllm (`VLLMRollout`): per round `generate_ids`, ids in and out, each
  request with its own budget, prefix caching on, the engine kept awake for the whole loop. All stop at the
  rollout's EOS ids, keep log-probs, n=1;
- the trajectories become the standard generated batch (hybridflow/agent/loop/batch.py) padded to the
  rollout's prompt / response widths, with the environment's per-turn rewards under `env_rewards`
  (the reward step uses them instead of the rule scorer) and `num_turns`, `tool_calls`, `stop_reason`;
- the loop's phase times (`LoopTimes.metrics()`: `agent/generate_time_s`, `agent/env_time_s`,
  `agent/loop_time_s`, `agent/rounds`, `agent/env_time_share`, `agent/tool_time_s`) go in `meta_info["metrics"]`.

The environment re-renders the prompt from the row's messages (with its tools), so the trajectory's
prompt ids may differ from (and be longer than) the dataset's; a prompt wider than rollout.prompt_length fails.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from hybridflow.agent.config import MultiTurnConfig
from hybridflow.agent.loop.batch import trajectories_to_batch
from hybridflow.agent.loop.env import ENVIRONMENTS, Environment
from hybridflow.agent.loop.runner import AgentLoopConfig, GenerateFn, LoopTimes, TurnEngine, run_agent_loop
from hybridflow.agent.loop.tools.tool_config import load_tool_config, tool_kwargs
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout.base import Rollout
from hybridflow.rollout.config import RolloutConfig, SamplingParams

ROW_COLUMNS = (keys.RAW_PROMPT, keys.DATA_SOURCE, keys.GROUND_TRUTH)
"""Non-tensor columns a multi-turn rollout needs in its prompt batch (extra_info is optional)."""


def generate_multi_turn(
    rollout: Rollout,
    prompts: DataProto,
    sampling: SamplingParams,
    config: RolloutConfig,
    wrap: Callable[[GenerateFn | TurnEngine], GenerateFn | TurnEngine] | None = None,
    interruptible: bool = False,
) -> DataProto:
    """`sampling.n` trajectories per prompt row as one generated batch (module docstring); `wrap`, when given,
    wraps the rollout's turn generator (the worker's: policy versions and partial rollout, rollout/partial.py);
    `interruptible` asks the rollout for a turn generator a weight push may cut (partial rollout)."""
    rows = dataset_rows(prompts, sampling.n)
    mt = config.multi_turn
    loop_cfg = AgentLoopConfig(
        response_length=config.response_length,
        max_turn_tokens=mt.max_turn_tokens or config.response_length,
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
    )
    labels = [f"dataset row {index} (sample {k})" for index in row_indices(prompts) for k in range(sampling.n)]
    times = LoopTimes()
    one = dataclasses.replace(sampling, n=1)
    # asked only when needed: a plugin rollout's turn_generator may take sampling alone
    turns = rollout.turn_generator(one, interruptible=True) if interruptible else rollout.turn_generator(one)
    with turns as generate:
        trajs = run_agent_loop(
            rows,
            env_factory(mt),
            wrap(generate) if wrap else generate,
            rollout.tokenizer,
            loop_cfg,
            rollout.eos_ids,
            mt.env,
            labels,
            times,
        )
    width = prompts.batch[keys.INPUT_IDS].shape[1]
    widest = max(len(t.prompt_ids) for t in trajs)
    if widest > width:
        raise ValueError(
            f"rollout.multi_turn: environment {mt.env!r} renders a prompt of {widest} tokens (messages and tool "
            f"schemas), wider than the prompt batch ({width}); raise data.max_prompt_length"
        )
    out = trajectories_to_batch(trajs, rollout.pad_id, width, config.response_length)
    out.batch[keys.ENV_REWARDS] = out.batch.pop(keys.TOKEN_LEVEL_SCORES)
    for key, column in prompts.non_tensor_batch.items():
        out.non_tensor_batch[key] = np.repeat(column, sampling.n, axis=0)
    out.meta_info.update(prompts.meta_info)
    out.meta_info[keys.META_METRICS] = {**out.meta_info.get(keys.META_METRICS, {}), **times.metrics()}
    return out


def dataset_rows(prompts: DataProto, n: int) -> list[dict[str, Any]]:
    """The verl-format row of every prompt, each repeated `n` times (adjacent)."""
    columns = prompts.non_tensor_batch
    missing = [k for k in ROW_COLUMNS if k not in columns]
    if missing:
        raise KeyError(f"rollout.multi_turn: the prompt batch lacks {missing}; batches from RLDataset carry them")
    extras = columns.get(keys.EXTRA_INFO, [None] * len(prompts))
    rows = [
        {
            "prompt": [dict(m) for m in columns[keys.RAW_PROMPT][i]],
            "data_source": str(columns[keys.DATA_SOURCE][i]),
            "reward_model": {"ground_truth": columns[keys.GROUND_TRUTH][i]},
            "extra_info": dict(extras[i] or {}),
        }
        for i in range(len(prompts))
    ]
    return [row for row in rows for _ in range(n)]


def row_indices(prompts: DataProto) -> list[Any]:
    """The dataset index of each prompt row (RLDataset's `index` column; else its position in the batch)."""
    if "index" in prompts.non_tensor_batch:
        return list(prompts.non_tensor_batch["index"])
    return list(range(len(prompts)))


def env_factory(config: MultiTurnConfig) -> Callable[[], Environment]:
    """A maker of fresh `config.env` environments, given the tool kwargs, tool allowlist and result length they accept."""
    cls = ENVIRONMENTS.get(config.env)
    offered = {
        "tool_kwargs": tool_kwargs(load_tool_config(config.tool_config_path), config.sandbox),
        "allowed_tools": list(config.allowed_tools),
        "max_tool_response_length": config.max_tool_response_length,
    }
    params = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in offered.items() if k in params}
    return lambda: cls(**kwargs)
