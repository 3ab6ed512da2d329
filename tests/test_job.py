"""train/job.py: the restart loop over a `Job` (build workers, make a trainer, fit; after a worker failure
tear down, release, restart from the newest checkpoint, keep the validation results)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest

from hybridflow.config.run import RunConfig
from hybridflow.controller.worker_group import WorkerError
from hybridflow.train.job import fit_with_restarts
from hybridflow.train.recovery import RunFailedError
from hybridflow.utils.config_loader import load_config
from tests.resolve_helpers import resolve_here


class Loader:
    def __len__(self) -> int:
        return 4

    def state_dict(self) -> dict:
        return {"at": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


class Inputs(NamedTuple):
    train_loader: Any
    resume_from: Path | None = None


class Group:
    name, workers = "g", [object()]  # one rank; Ray knows nothing of it

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def init_model(self) -> None:
        self.log.append("init")

    def shutdown(self) -> None:
        self.log.append("shutdown")


class Trainer:
    def __init__(self, fail: bool) -> None:
        self.fail, self.global_step, self.val = fail, 0, None

    def fit(self) -> str:
        self.global_step = 1
        self.val = self.val or "validated once"
        if self.fail:
            raise WorkerError("rank 0 died", "g", (0,), "update_actor")
        return "done"


class FakeJob:
    """A Job whose first `failures` trainers lose a worker."""

    label = "loading"

    def __init__(self, config: Any, failures: int) -> None:
        self.config, self.failures, self.log = config, failures, []
        self.trainer: Trainer | None = None

    def build_workers(self) -> list:
        self.log.append("build")
        return [Group(self.log)]

    def release(self) -> None:
        self.log.append("release")

    def make_trainer(self, inputs: Inputs, tracker: Any, recovery: Any) -> Trainer:
        fresh = Trainer(fail=self.failures > 0)
        self.failures -= 1
        if self.trainer is not None:
            fresh.val = self.trainer.val
        self.trainer = fresh
        return fresh


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """The fake workers need no Ray (the config says ray: the local backend has no restarts)."""
    import hybridflow.train.job as job

    monkeypatch.setattr(job, "start_backend", lambda cfg: None)


def config(tmp_path: Path, restarts: int) -> Any:
    overrides = ["trainer.backend=ray", "trainer.n_workers_per_node=1", f"trainer.max_restarts={restarts}"]
    overrides += [f"trainer.log_dir={tmp_path}", "trainer.logger=[jsonl]", "data.train_batch_size=4"]
    return resolve_here(load_config(RunConfig, None, overrides), 4).config


def test_a_worker_failure_restarts_the_job_and_keeps_its_validation(tmp_path: Path):
    job = FakeJob(config(tmp_path, restarts=1), failures=1)
    trainer, result = fit_with_restarts(job, Inputs(Loader()))
    assert result == "done" and trainer.val == "validated once"
    assert job.log == ["build", "init", "shutdown", "release"] * 2


def test_spent_restarts_end_the_run_with_one_line(tmp_path: Path):
    job = FakeJob(config(tmp_path, restarts=0), failures=1)
    with pytest.raises(RunFailedError, match="rank 0 died|update_actor"):
        fit_with_restarts(job, Inputs(Loader()))
    assert job.log == ["build", "init", "shutdown", "release"]
