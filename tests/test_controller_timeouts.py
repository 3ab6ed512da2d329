"""No hang: a stuck rank becomes an error naming the group, rank(s) and method (real Ray workers).

Each test builds its own group (a timed-out group is broken on purpose) and waits for its actors
directly first, so a slow actor start never counts against the short timeouts used here.
"""

from __future__ import annotations

import time

import pytest
import ray
from controller_workers import Staller, rows

from hybridflow.controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridflow.controller.worker_group import Timeouts, WorkerError, WorkerTimeoutError
from hybridflow.protocol import DataProtoFuture

SETTING = "test.call_timeout_s"
CLOCK_SLACK_S = 0.05
"""The deadline runs on the wall clock (time.time: a future carries it to other processes) and these tests
measure on the monotonic one; the two can differ by milliseconds over a call (2.989 s measured for a 3 s
timeout, 2026-11-28)."""


@pytest.fixture
def make_staller(ray_local):
    """make(name, call_s, collective_s, stuck_rank) -> a started 2-rank Staller group."""
    made = []

    def make(name: str, call_s: float, collective_s: float = 60.0, stuck_rank: int = 1) -> RayWorkerGroup:
        pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix=f"{name}_")
        group = RayWorkerGroup(
            pool,
            RayClassWithInitArgs(Staller, stuck_rank=stuck_rank),
            name_prefix=name,
            timeouts=Timeouts(call_s, collective_s, SETTING),
        )
        made.append((pool, group))
        ray.get([w.__ray_ready__.remote() for w in group.workers], timeout=60)
        return group

    yield make
    for pool, group in made:
        group.shutdown()
        pool.remove()


def test_a_stuck_rank_in_a_blocking_call_times_out_naming_it_and_is_killed(make_staller):
    group = make_staller("stuck", call_s=3)
    assert group.rank_of() == [0, 1]  # a call well under the timeout is unaffected
    start = time.monotonic()
    with pytest.raises(
        WorkerTimeoutError,
        match=r"group stuck method stall: rank\(s\) \[1\] did not return "
        r"within 3 s .*rank\(s\) \[0\] did.*killed.*" + SETTING,
    ):
        group.stall()
    assert 3 - CLOCK_SLACK_S <= time.monotonic() - start < 10
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"group stuck rank 1 method rank_of died"):
        group.rank_of()  # the killed rank fails the next call at once instead of queueing it for ever
    assert time.monotonic() - start < 5


def test_a_stuck_rank_behind_a_future_times_out_naming_it(make_staller):
    group = make_staller("stuck_future", call_s=3)
    start = time.monotonic()
    future = group.stall_async(rows(4))
    assert isinstance(future, DataProtoFuture)
    with pytest.raises(
        WorkerTimeoutError,
        match=r"group stuck_future method stall_async: rank\(s\) \[1\] "
        r"did not return within 3 s .*rank\(s\) \[0\] did",
    ):
        future.chunk(2)[0].get()  # a chunk keeps the call's deadline
    assert 3 - CLOCK_SLACK_S <= time.monotonic() - start < 10


def test_a_future_resolved_by_another_groups_workers_keeps_its_deadline_there(make_staller):
    producer, consumer = make_staller("producer", call_s=3), make_staller("consumer", call_s=60, stuck_rank=-1)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"group producer method stall_async: rank\(s\) \[1\]") as info:
        consumer.stall_proto(producer.stall_async(rows(4)))  # each consumer rank resolves the future itself
    notes = getattr(info.value, "__notes__", [])
    assert any("group consumer rank" in n and "method stall_proto" in n for n in notes), notes
    assert time.monotonic() - start < 10  # the producer's 3 s, not the consumer's 60 s


def test_a_collective_one_rank_never_joins_fails_on_the_waiting_rank_naming_it(make_staller):
    group = make_staller("collective", call_s=60, collective_s=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        group.all_reduce_without_stuck()
    assert "Timed out" in str(info.value) and not isinstance(info.value, WorkerTimeoutError)  # gloo's, not the call's
    notes = getattr(info.value, "__notes__", [])
    assert any("group collective rank 0 method all_reduce_without_stuck" in n for n in notes), notes
    assert time.monotonic() - start < 20


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="call_s must be > 0"):
        Timeouts(call_s=0)
    assert Timeouts(call_s=None).call_s is None
