"""verl-style worker classes: `ClassWithInitArgs(cls=ray.remote(Worker), ...)` on every backend."""

from __future__ import annotations

import logging

import pytest
import ray
from controller_workers import ActorRole, CriticRole, Gate, Probe

from hybridflow import ClassWithInitArgs
from hybridflow.controller.colocate import create_colocated_worker_cls
from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


def test_ray_remote_class_is_unwrapped_and_keeps_its_actor_options(caplog):
    remote = ray.remote(max_concurrency=2, max_restarts=1, num_cpus=4, resources={"big": 1})(Probe)
    with caplog.at_level(logging.WARNING, logger="hybridflow.controller.resource_pool"):
        cwa = RayClassWithInitArgs(cls=remote, offset=3)
    assert cwa.cls is Probe and cwa.kwargs == {"offset": 3}
    assert cwa.ray_options == {"max_concurrency": 2, "max_restarts": 1}  # the pool owns num_cpus, resources
    assert "['num_cpus', 'resources'] are ignored" in caplog.text
    assert cwa.update_options({"max_task_retries": 2}).ray_options["max_task_retries"] == 2
    plain = ClassWithInitArgs(ray.remote(Probe))
    assert plain.cls is Probe and plain.ray_options == {}
    with pytest.raises(TypeError, match="needs a worker class"):
        ClassWithInitArgs(Probe())


def test_local_backend_builds_the_unwrapped_class():
    group = LocalWorkerGroup(None, ClassWithInitArgs(ray.remote(max_concurrency=2)(Probe), offset=3))
    assert type(group.worker) is Probe
    assert group.add_rank(1, y=2) == [3] and group.info()[0]["offset"] == 3


def test_colocated_roles_pass_on_their_options_and_must_agree():
    actor = ClassWithInitArgs(ray.remote(max_concurrency=2)(ActorRole), 100)
    fused = create_colocated_worker_cls({"actor": actor, "critic": CriticRole})
    assert fused.ray_options == {"max_concurrency": 2}
    with pytest.raises(ValueError, match="disagree on its option 'max_concurrency'"):
        create_colocated_worker_cls({"actor": actor, "critic": ray.remote(max_concurrency=4)(CriticRole)})


def _overlap(cls_with_init: ClassWithInitArgs, name: str, timeout_s: float) -> tuple[list, list]:
    """(wait_open results, open results) on a 2-rank group: did each rank run the two calls at once?"""
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix=f"{name}_")
    group = RayWorkerGroup(pool, cls_with_init, name_prefix=name)
    try:
        waiting = group.wait_open(timeout_s)  # non-blocking: per-rank refs
        opened = group.open()
        return ray.get(waiting), opened
    finally:
        group.shutdown()
        pool.remove()


def test_verl_style_remote_class_runs_with_its_options_through_ray(ray_local):
    remote = ray.remote(max_concurrency=2, num_cpus=8, runtime_env={"env_vars": {"GATE_TAG": "kept"}})(Gate)
    cwa = ClassWithInitArgs(cls=remote)
    waited, opened = _overlap(cwa, "gate2", timeout_s=60)
    assert opened == [0, 1] and waited == [True, True]  # max_concurrency=2: open ran while wait_open waited
    pool = RayResourcePool([1], num_cpus_per_process=0.5, name_prefix="gate_env_")
    group = RayWorkerGroup(pool, cwa, name_prefix="gate_env")
    try:  # the decorator's runtime_env reaches the actor beside the group's own variables
        assert group.getenv("GATE_TAG") == ["kept"] and group.getenv("RANK") == ["0"]
    finally:
        group.shutdown()
        pool.remove()


def test_without_max_concurrency_the_calls_do_not_overlap(ray_local):
    waited, opened = _overlap(ClassWithInitArgs(ray.remote(Gate)), "gate1", timeout_s=1)
    assert opened == [0, 1] and waited == [False, False]  # the control: one call at a time
