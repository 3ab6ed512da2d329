"""Keep libraries' progress bars and info logs off the console unless `trainer.verbose`.

Where the noise comes from: transformers draws a "Loading weights" bar for every
`from_pretrained` (actor, reference and rollout copies: three per worker) and a
"Writing model shards" bar for every `save_pretrained`; its GGUF reader draws a
plain tqdm bar; and Ray forwards each worker's stderr to the controller behind a
`(WorkerClass pid=...)` prefix, so every bar is repeated once per worker.
Warnings and errors are left alone: a worker's failure still reaches the console.

Ray workers are fresh processes: `worker_env` gives the env vars that switch the
bars and info logs off there at import (the worker groups pass them through the
actors' runtime_env). The controller's own process, which also runs the worker of
the in-process local backend, is quietened for a block only by `quiet_libraries`,
which puts back what it changed (except vllm's log level, fixed at its first import).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

VLLM_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
"""vllm's log level env var."""

QUIET_WORKER_ENV: dict[str, str] = {
    # huggingface_hub's bars; transformers reads it at import for its own bars too
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # every other tqdm bar (tqdm >= 4.66 takes its defaults from TQDM_* env vars)
    "TQDM_DISABLE": "1",
    "TRANSFORMERS_VERBOSITY": "warning",
    # vllm (rollout.name=vllm) logs at INFO, and warns at every weight sync and about CPU tuning hints;
    # its errors still reach the console (they are raised as exceptions too)
    VLLM_LEVEL_ENV: "ERROR",
}
"""The env vars `worker_env` sets in quiet mode."""


def worker_env(verbose: bool) -> dict[str, str]:
    """Env vars for worker processes: `QUIET_WORKER_ENV`, or none when `verbose` (the libraries' defaults)."""
    return {} if verbose else dict(QUIET_WORKER_ENV)


@contextmanager
def quiet_libraries(verbose: bool = False) -> Iterator[None]:
    """For the block, in this process: transformers' progress bars off and its logs at WARNING or above.

    Restores transformers' verbosity and tqdm hook on exit, so the process's logging is
    as it was afterwards. Does nothing when `verbose`.
    """
    if verbose:
        yield
        return
    from transformers.utils import logging as tf_logging  # noqa: PLC0415  (lazy: transformers is heavy; utils/ stays light)

    level = tf_logging.get_verbosity()
    previous_hook = tf_logging.set_tqdm_hook(_disabled_bar)
    tf_logging.set_verbosity(max(level, logging.WARNING))
    # vllm reads its level once, when first imported: a vllm rollout built in the block stays quiet
    vllm_level = os.environ.get(VLLM_LEVEL_ENV)
    os.environ[VLLM_LEVEL_ENV] = QUIET_WORKER_ENV[VLLM_LEVEL_ENV]
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        tf_logging.set_tqdm_hook(previous_hook)
        if vllm_level is None:
            os.environ.pop(VLLM_LEVEL_ENV, None)
        else:
            os.environ[VLLM_LEVEL_ENV] = vllm_level


def _disabled_bar(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return factory(*args, **{**kwargs, "disable": True})
