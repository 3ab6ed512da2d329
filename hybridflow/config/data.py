"""Config sections of a run's data and reward: the task files, batch and length limits, reward scoring.

Each section is a dataclass with a default and a docstring per field; bad values fail in `__post_init__`
with a message naming the keys. Batch sizes here are global (per run), not per worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hybridflow.data.dataset import TRUNCATIONS
from hybridflow.data.tasks import get_task, make_difficulty
from hybridflow.utils.config_loader import Section


def one_of(key: str, value: Any, allowed: tuple) -> None:
    """Raise a ValueError naming `key` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")


def positive(**values: Any) -> None:
    """Raise a ValueError naming the key of the first value below 1 (None: unset, allowed)."""
    for key, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


@dataclass
class TaskFilesConfig(Section):
    """Where a run's examples come from: parquet files, or a task generated once into a cache."""

    train_files: Any = field(default_factory=list)
    """Training parquet file(s): one path or a list. Empty: generate `task`."""
    val_files: Any = field(default_factory=list)
    """Validation parquet file(s). Empty: the generated `task`'s test split, or train_files when those are given."""
    task: str | None = "arithmetic"
    """Task builder (hybridflow.data.TASKS) used to generate files when train_files is empty."""
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    """Difficulty settings passed to the task builder, e.g. {max_digits: 1}."""
    task_dir: str = "~/.cache/hybridflow/data"
    """Directory the generated task files are written to."""
    gen_train_size: int = 2048
    """Number of training problems to generate."""
    gen_val_size: int = 256
    """Number of validation problems to generate."""

    def __post_init__(self) -> None:
        self.train_files = _as_list(self.train_files, "data.train_files")
        self.val_files = _as_list(self.val_files, "data.val_files")
        if not self.train_files and not self.task:
            raise ValueError("set data.train_files to parquet file(s) or data.task to a task builder name")
        if self.task and not self.train_files:
            get_task(self.task)
            make_difficulty(self.task, **self.task_kwargs)
        positive(**{"data.gen_train_size": self.gen_train_size, "data.gen_val_size": self.gen_val_size})


@dataclass
class DataConfig(TaskFilesConfig):
    """Where prompts come from (verl-format parquet) and how long prompts and responses may be."""

    train_batch_size: int = 32
    """Prompts per training step, for the whole run (each is sampled rollout.n times)."""
    val_batch_size: int | None = None
    """Prompts per validation generate call; None runs the whole validation set at once."""
    max_prompt_length: int = 128
    """Prompt tokens after the chat template; prompts are left-padded to this length."""
    max_response_length: int = 64
    """Most tokens generated per response; responses are right-padded to this length."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length (the count is logged) instead of applying `truncation`."""
    truncation: str = "error"
    """For overlong prompts when not filtering: "error", "left" (keep the end) or "right" (keep the start)."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (order derived from seed and epoch)."""
    seed: int = 0
    """Seed of the epoch shuffles and of task generation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(
            **{
                "data.train_batch_size": self.train_batch_size,
                "data.val_batch_size": self.val_batch_size,
                "data.max_prompt_length": self.max_prompt_length,
                "data.max_response_length": self.max_response_length,
            }
        )
        one_of("data.truncation", self.truncation, TRUNCATIONS)


def _as_list(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [str(value)]
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) for v in value):
        return [str(v) for v in value]
    raise ValueError(f"{key} must be a path or a list of paths, got {value!r}")


@dataclass
class CustomRewardFunctionConfig(Section):
    """A reward function loaded from a user's Python file."""

    path: str | None = None
    """Python file defining the function; None uses the built-in rule scorers."""
    name: str = "compute_score"
    """Function in that file: (data_source, solution_str, ground_truth, extra_info=None) -> float."""

    def __post_init__(self) -> None:
        if self.path is not None and not os.path.isfile(os.path.expanduser(self.path)):
            raise ValueError(f"custom_reward_function.path {self.path!r} does not exist")
        if not self.name.isidentifier():
            raise ValueError(f"custom_reward_function.name must be a Python identifier, got {self.name!r}")


NON_FINITE_POLICIES = ("error", "drop")
"""reward.non_finite values."""


@dataclass
class RewardConfig(Section):
    """How responses are scored."""

    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """User reward function; unset means the rule scorer chosen by each row's data_source."""
    num_workers: int = 0
    """Processes for rule scoring (0: score in the controller process; worth it only for slow scorers)."""
    non_finite: str = "error"
    """A NaN or infinite score from the reward function: "error" stops the run at that step naming the row;
    "drop" masks the row out of the update (its score 0, its response_mask zeroed after the parity guard) and
    counts it in reward/non_finite_dropped."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if self.non_finite not in NON_FINITE_POLICIES:
            raise ValueError(f"reward.non_finite must be one of {NON_FINITE_POLICIES}, got {self.non_finite!r}")
