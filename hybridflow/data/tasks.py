"""Task builders: write generated problems as parquet in verl's row format.

Every row has the columns a verl dataset has, so a file written here and a
file prepared for verl are read the same way by `RLDataset`:

- `data_source` (str): picks the reward scorer (`hybridflow.rewards`).
- `prompt` (list of chat messages): `[{"role": "user", "content": ...}]`.
- `ability` (str): a free-form tag, here always "math".
- `reward_model` (dict): `{"style": "rule", "ground_truth": str}`.
- `extra_info` (dict): `split`, `index` and task-specific fields.

A task is a function `make_problem(rng, spec) -> Problem` plus a difficulty
spec dataclass; `build_task` draws `train_size` and `test_size` problems from
two independent seeded streams, so the same arguments always give the same
files. Test problems that also occur in the train split are redrawn (a few
tries, then kept) so held-out accuracy means something.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hybridflow.utils.registry import Registry

logger = logging.getLogger(__name__)
_REDRAW_TRIES = 20


@dataclass
class Problem:
    """One generated problem before it becomes a parquet row."""

    question: str
    """The user message shown to the model."""
    ground_truth: str
    """What the scorer compares against (a number, or JSON for countdown)."""
    extra: dict[str, Any]
    """Task-specific fields stored in `extra_info` (e.g. a worked solution)."""


@dataclass
class TaskSpec:
    """A registered task: its generator, difficulty dataclass and data_source."""

    make_problem: Callable[[np.random.Generator, Any], Problem]
    """Draws one problem from `rng` at the difficulty given by a `difficulty_cls` instance."""
    difficulty_cls: type
    """Dataclass of the task's difficulty knobs (keyword arguments of `build_task`)."""
    data_source: str
    """Value written to the `data_source` column; selects the reward scorer."""


TASKS: Registry[TaskSpec] = Registry("task", "data.task", "add one with @hybridflow.data.register_task")
"""Task builders by name (the package `hybridflow.data` registers the built-in ones)."""


def register_task(name: str, difficulty_cls: type, data_source: str | None = None, *, override: bool = False):
    """Decorator registering `make_problem(rng, difficulty) -> Problem` under `name`."""

    def wrap(fn: Callable[[np.random.Generator, Any], Problem]):
        TASKS.register(name, TaskSpec(fn, difficulty_cls, data_source or name), override=override)
        return fn

    return wrap


class DifficultyError(TypeError, ValueError):
    """A difficulty setting the task does not have: a TypeError, as any unexpected keyword argument is, and a
    ValueError, as the CLI's user errors are (one line, no traceback); load_config prefixes the config section."""


def get_task(name: str) -> TaskSpec:
    """The registered task `name`; unknown names fail listing the known ones."""
    return TASKS.get(name)


def make_difficulty(name: str, **difficulty: Any) -> Any:
    """Build task `name`'s difficulty dataclass, naming unknown knobs."""
    cls = get_task(name).difficulty_cls
    known = [f.name for f in dataclasses.fields(cls)]
    for key in difficulty:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=3)
            raise DifficultyError(
                f"task {name!r} has no difficulty setting {key!r}"
                + (f" (did you mean {near}?)" if near else "")
                + f"; known settings: {known}"
            )
    return cls(**difficulty)


def make_rows(
    name: str, size: int, split: str, seed: int, difficulty: Any, exclude: set[str] | None = None
) -> list[dict[str, Any]]:
    """`size` verl-format rows of task `name` drawn from the stream (seed, split)."""
    spec = get_task(name)
    rng = np.random.default_rng([seed, _split_id(split)])
    exclude = exclude or set()
    rows = []
    for index in range(size):
        problem = spec.make_problem(rng, difficulty)
        for _ in range(_REDRAW_TRIES):
            if problem.question not in exclude:
                break
            problem = spec.make_problem(rng, difficulty)
        rows.append(_to_row(spec.data_source, problem, split, index))
    return rows


def build_task(
    name: str, out_dir: str | Path, train_size: int, test_size: int, seed: int = 0, **difficulty: Any
) -> tuple[str, str]:
    """Generate task `name` and write `{name}_train.parquet`, `{name}_test.parquet`.

    Returns the two paths. Keyword arguments set the task's difficulty (see the
    task's difficulty dataclass, e.g. `ArithmeticDifficulty`).
    """
    if train_size < 1 or test_size < 1:
        raise ValueError(f"train_size and test_size must be >= 1, got {train_size}, {test_size}")
    level = make_difficulty(name, **difficulty)
    train = make_rows(name, train_size, "train", seed, level)
    seen = {row["prompt"][0]["content"] for row in train}
    test = make_rows(name, test_size, "test", seed, level, exclude=seen)
    overlap = sum(row["prompt"][0]["content"] in seen for row in test)
    if overlap:
        logger.warning(
            "build_task(%s): %d of %d test problems also occur in the train split; the "
            "difficulty settings allow too few distinct problems for a clean held-out split",
            name,
            overlap,
            test_size,
        )
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, rows in (("train", train), ("test", test)):
        path = out / f"{name}_{split}.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]


def _to_row(data_source: str, problem: Problem, split: str, index: int) -> dict[str, Any]:
    # Every extra_info value is stored as a string so that rows of one file
    # share one parquet struct type regardless of the task's field types.
    extra = {key: v if isinstance(v, str) else json.dumps(v) for key, v in problem.extra.items()}
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": problem.ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def _split_id(split: str) -> int:
    return {"train": 0, "test": 1}[split]
