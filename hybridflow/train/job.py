"""The restart loop every trainer shares (`hybridflow train`, `hybridflow sft`): start a job's workers, fit
its trainer, and after a recoverable worker failure do it again from the newest checkpoint.

A `Job` is one run's workers and trainer (PPO: cli/train.py `PPOJob`; SFT: cli/sft.py
`SFTJob`); `fit_with_restarts(job, inputs)` drives it. What counts as a worker failure, the restart
budget and the checkpoint a restart resumes from are train/recovery.py's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import yaml

from hybridflow.controller.worker_group import WorkerGroup
from hybridflow.train.recovery import Failure, Recovery
from hybridflow.utils.config_loader import to_yaml
from hybridflow.utils.progress import phase
from hybridflow.utils.quiet import quiet_libraries
from hybridflow.utils.tracking import Tracking


class Trainer(Protocol):
    """What the restart loop needs of a trainer (PPOTrainer, SFTTrainer)."""

    global_step: int
    """The step in progress or last finished (a restart redoes the steps after its checkpoint)."""

    def fit(self) -> Any:
        """Train to the end; returns the trainer's result (validation metrics / losses)."""


class Inputs(Protocol):
    """What the controller read before any worker started (RunInputs, SFTInputs: NamedTuples)."""

    train_loader: Any
    resume_from: Path | None

    def _replace(self, *, resume_from: Path | None) -> Inputs: ...


class Job(Protocol):
    """One run's workers and trainer, as `fit_with_restarts` drives them."""

    config: Any
    """The resolved run config (its trainer section and world_size are read here)."""
    label: str
    """The phase line shown while the workers load their models, e.g. "loading models"."""

    def build_workers(self) -> list[WorkerGroup]:
        """Create the worker groups (processes up, models not loaded) and return every distinct group."""

    def release(self) -> None:
        """Free what `build_workers` placed; called after every group has shut down."""

    def make_trainer(self, inputs: Inputs, tracker: Tracking, recovery: Recovery) -> Trainer:
        """A trainer over the workers built last. From the job's previous trainer (before a restart) it keeps
        the validation results, so validation before training is not redone."""


def fit_with_restarts(job: Job, inputs: Inputs) -> tuple[Trainer, Any]:
    """Start `job`'s workers and fit a trainer; after a recoverable worker failure, again from the newest
    checkpoint (trainer.max_restarts, train/recovery.py). Returns (the last trainer, what its fit returned).

    A failure is described while the workers still exist, and handled after they were torn down."""
    t = job.config.trainer
    recovery = Recovery(t, inputs.resume_from)
    loader_start = inputs.train_loader.state_dict()
    trainer: Trainer | None = None
    with Tracking(t.project_name, t.experiment_name, t.logger, Path(t.log_dir), config=plain(job.config)) as tracker:
        while True:
            try:
                with started_workers(job) as groups:
                    try:
                        if recovery.resume_from is None:  # (re)starting at step 0: the loader too
                            inputs.train_loader.load_state_dict(loader_start)
                        trainer = job.make_trainer(inputs._replace(resume_from=recovery.resume_from), tracker, recovery)
                        return trainer, trainer.fit()
                    except Exception as err:
                        raise _recoverable(recovery, err, groups, trainer) from err
            except _Recoverable as wrapped:
                recovery.restart(wrapped.failure, tracker.rewind)
            except Exception as err:  # raised while starting the workers or loading their models
                recovery.restart(_recoverable(recovery, err, [], trainer).failure, tracker.rewind)


@contextmanager
def started_workers(job: Job) -> Iterator[list[WorkerGroup]]:
    """Start the backend and build the job's worker groups, load their models (one phase line each, libraries
    quiet unless trainer.verbose), yield the groups; at exit shut every group down, then `job.release()`."""

    cfg = job.config
    n = cfg.world_size
    with phase(f"starting {n} worker{'s' if n > 1 else ''} ({cfg.trainer.backend})"):
        start_backend(cfg)
        groups = job.build_workers()
    try:
        with phase(job.label), quiet_libraries(cfg.trainer.verbose):
            for group in groups:
                group.init_model()
        yield groups
    finally:
        for group in groups:
            group.shutdown()
        job.release()


def start_backend(cfg: Any) -> None:
    """Ray: join the cluster at RAY_ADDRESS (started with `ray start` on every node), else start a local one."""
    if cfg.trainer.backend != "ray":
        return
    import ray  # noqa: PLC0415  (lazy: the local backend runs without Ray)

    from hybridflow.controller.ray import RayStartTimeout, init_local_ray  # noqa: PLC0415  (lazy: the local backend runs without Ray)

    level = logging.INFO if cfg.trainer.verbose else logging.WARNING
    if os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=level)
        return
    cpus = max(os.cpu_count() or 1, cfg.world_size * cfg.trainer.cpus_per_worker)
    try:
        init_local_ray(num_cpus=cpus, start_timeout_s=cfg.trainer.ray_start_timeout_s, logging_level=level)
    except RayStartTimeout as err:
        raise RayStartTimeout(
            f"{err} (trainer.ray_start_timeout_s={cfg.trainer.ray_start_timeout_s:g}: raise it); "
            "trainer.backend=local runs one in-process worker without Ray"
        ) from None


def plain(cfg: Any) -> dict:
    """The config as plain YAML data (what the loggers record)."""

    return yaml.safe_load(to_yaml(cfg))


class _Recoverable(Exception):
    """Carries a `Failure` out of the workers' block, through their teardown."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.what)
        self.failure = failure


def _recoverable(recovery: Recovery, err: Exception, groups: list, trainer: Trainer | None) -> _Recoverable:
    """`err` as a recoverable failure of the step in progress, or `err` itself re-raised when it is not one."""
    failure = recovery.failure(err, groups, trainer.global_step if trainer else 0)
    if failure is None:
        raise err
    return _Recoverable(failure)
