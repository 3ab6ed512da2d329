"""The pieces of worker-failure recovery that need no workers: restart budget, failure classification,
fault-point parsing, metric rewind, config checks. The end-to-end runs are in test_fault_tolerance.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from faults.calls import FaultPoint, call_step, parse_faults
from ray.exceptions import ActorDiedError, RayTaskError

from hybridflow.config.resolve import resolve_trainer
from hybridflow.config.run import RunConfig
from hybridflow.controller.worker_group import WorkerError, WorkerTimeoutError
from hybridflow.protocol import DataProto
from hybridflow.train.recovery import Recovery, RestartBudget, RunFailedError, describe, is_worker_failure
from hybridflow.utils.config_loader import load_config
from hybridflow.utils.tracking import Tracking


def test_restart_budget_counts_only_restarts_inside_the_window():
    budget = RestartBudget(max_restarts=2, window_s=100)
    assert [budget.take(0), budget.take(10), budget.take(20)] == [1, 2, 0]  # the third within 100 s is refused
    assert budget.take(105) == 2  # the one at t=0 left the window
    assert RestartBudget(0, 100).take(0) == 0


def _task_error(cause: Exception) -> RayTaskError:
    return RayTaskError("update_actor", "Traceback ...", cause).as_instanceof_cause()


def test_worker_failures_are_told_from_bugs():
    assert is_worker_failure(WorkerTimeoutError("stuck", "g", (1,), "m"), [])
    assert is_worker_failure(ActorDiedError(), [])
    assert is_worker_failure(_task_error(RuntimeError("[gloo/pair.cc:553] Connection closed by peer")), [])
    assert is_worker_failure(_task_error(dist.DistBackendError("timed out")), [])
    bug = _task_error(ValueError("shape mismatch"))
    assert not is_worker_failure(bug, [])
    assert is_worker_failure(bug, ["group g rank 1 (pid 7, node ab)"])  # a peer is dead: its death is the cause
    assert not is_worker_failure(KeyError("x"), [])


def test_a_worker_error_pickles_with_where_it_happened():
    import pickle

    err = pickle.loads(pickle.dumps(WorkerTimeoutError("stuck", "actor", (1, 2), "update_actor")))
    assert (type(err), str(err), err.group, err.ranks, err.method) == (
        WorkerTimeoutError,
        "stuck",
        "actor",
        (1, 2),
        "update_actor",
    )


def test_a_failure_seen_by_a_surviving_rank_names_the_dead_one_and_the_method():
    err = _task_error(RuntimeError("[/x/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
    err.add_note("hybridflow: raised in group g_actor rank 0 method update_actor; rank(s) [1] still running")
    text = describe(err, [], ["group g_actor rank 1 (pid 77, node abcd1234)"])
    assert text == (
        "group g_actor rank 1 (pid 77, node abcd1234) died in update_actor (rank 0 saw RuntimeError: "
        "Connection closed by peer [127.0.0.1]:1234)"
    ), text
    assert describe(err, [], []) == (
        "group g_actor rank 0 method update_actor raised RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    )


def test_fault_points_parse_and_find_the_calls_step():
    assert parse_faults("update_actor@3:1, save_checkpoint@2:0:hang") == (
        FaultPoint("update_actor", 3, 1, "kill"),
        FaultPoint("save_checkpoint", 2, 0, "hang"),
    )
    for bad in ("update_actor@3", "update_actor@x:1", "update_actor@3:1:explode"):
        with pytest.raises(ValueError, match="METHOD@STEP:RANK"):
            parse_faults(bad)
    assert call_step((DataProto(meta_info={"global_step": 4}),), {}) == 4
    assert call_step(("/ckpt/global_step_6.tmp-123",), {}) == 6
    assert call_step((DataProto(meta_info={}),), {"n": 3}) is None


def test_rewind_drops_only_the_trailing_records_after_the_step(tmp_path: Path):
    with Tracking("p", "e", ["jsonl"], tmp_path) as tracker:
        for step in (0, 1, 2, 3, 0, 1, 2, 3):  # an earlier run's records, then this run's up to step 3
            tracker.log({"x": float(step)}, step=step)
        tracker.rewind(1)
        tracker.log({"x": 2.5}, step=2)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 0, 1, 2]


def test_exhausted_restarts_name_the_worker_and_the_fix(tmp_path: Path):
    cfg = load_config(RunConfig, None, ["trainer.max_restarts=0"]).trainer
    recovery = Recovery(cfg, None)
    from hybridflow.train.recovery import Failure

    failure = Failure("group g rank 1 (pid 7, node ab) died in update_actor", 3, WorkerError("died"))
    with pytest.raises(
        RunFailedError,
        match=r"worker failure at step 3: group g rank 1 \(pid 7, node ab\) died "
        r"in update_actor; trainer.max_restarts=0\. Running the same command "
        r"again starts again from step 0.*raise trainer.max_restarts",
    ):
        recovery.restart(failure, rewind=lambda step: None)


def test_recovery_time_runs_from_the_failure_to_the_resume(monkeypatch):
    cfg = load_config(RunConfig, None, ["trainer.max_restarts=2"]).trainer
    recovery = Recovery(cfg, None)
    clock = iter([100.0, 112.5])
    monkeypatch.setattr("hybridflow.train.recovery.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("hybridflow.train.recovery.dead_workers", lambda groups: [])
    recovery.resumed()  # a first start is no recovery
    assert recovery.metrics()["fault/recovery_s"] == 0.0
    assert recovery.failure(WorkerError("died"), [], step=3) is not None  # t = 100
    recovery.resumed()  # t = 112.5
    assert recovery.metrics()["fault/recovery_s"] == 12.5
    recovery.resumed()  # nothing in progress: unchanged, the clock is not read again
    assert recovery.metrics()["fault/recovery_s"] == 12.5


def test_max_restarts_is_checked_and_resolved_per_backend():
    with pytest.raises(ValueError, match="trainer.max_restarts must be >= 0"):
        load_config(RunConfig, None, ["trainer.max_restarts=-1"])
    with pytest.raises(ValueError, match="trainer.restart_window_s must be > 0"):
        load_config(RunConfig, None, ["trainer.restart_window_s=0"])
    with pytest.raises(ValueError, match="trainer.max_restarts=2 needs trainer.backend=ray"):
        load_config(
            RunConfig, None, ["trainer.backend=local", "trainer.n_workers_per_node=1", "trainer.max_restarts=2"]
        )
    ray_t = load_config(RunConfig, None, []).trainer
    local_t = load_config(RunConfig, None, ["trainer.backend=local", "trainer.n_workers_per_node=1"]).trainer
    assert resolve_trainer(ray_t, 10, 1).max_restarts == 3 and resolve_trainer(local_t, 10, 1).max_restarts == 0
