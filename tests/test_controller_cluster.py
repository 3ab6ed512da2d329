"""Placement over two Ray nodes (ray.cluster_utils.Cluster on this machine, loopback only)."""

from __future__ import annotations

import pytest
from conftest import loopback_cluster
from controller_workers import Probe, rows

from hybridflow.controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

pytestmark = pytest.mark.slow  # two extra raylets and two workers: ~1 min on 2 busy cores


@pytest.fixture(scope="module")
def two_nodes(monkeypatch_module):
    """A head and a worker node of 1 CPU each; the tests' usual local Ray is restored afterwards."""
    yield from loopback_cluster(monkeypatch_module)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_one_rank_per_node_in_node_order(two_nodes):
    pool = RayResourcePool([1, 1], name_prefix="two_nodes_")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(Probe), name_prefix="spread")
    try:
        slots = pool.slots()
        assert len({s.node_id for s in slots}) == 2  # each placement group on its own node
        infos = group.info()
        assert [i["rank"] for i in infos] == [0, 1]
        assert [(i["local_rank"], i["local_world_size"]) for i in infos] == [(0, 1), (0, 1)]
        assert {i["master_addr"] for i in infos} == {"127.0.0.1"}  # the node IP Ray reports for rank 0
        assert group.all_reduce_ranks() == [3.0, 3.0]  # gloo across the two nodes
        assert group.affine(rows(3)).batch["rank"].tolist() == [0, 0, 1]
    finally:
        group.shutdown()
        pool.remove()


def test_a_node_too_small_for_its_placement_group_fails_clearly(two_nodes):
    pool = RayResourcePool([2], ready_timeout_s=2, name_prefix="too_big_")
    with pytest.raises(RuntimeError, match="were not scheduled"):
        pool.slots()
