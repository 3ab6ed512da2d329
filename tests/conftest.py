"""Shared test fixtures.

`ray_local`: one loopback-only local Ray (2 CPUs) for the whole session. Its
workers get this folder on PYTHONPATH, so worker classes defined in a test
module (imported by pytest under the module's bare name) load in the actors.
`isolated_registries`: every name registered during a test is gone after it (a plugin
imported in the pytest process must not replace a built-in for the tests after it).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from hybridflow.utils.registry import Registry

TESTS_DIR = str(Path(__file__).resolve().parent)
RAY_NUM_CPUS = 2


def start_local_ray(num_cpus: int = RAY_NUM_CPUS) -> None:
    """Start the tests' local Ray unless one is already up."""
    import ray

    if ray.is_initialized():
        return
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray with 2 CPUs on loopback, shut down at the end of the session."""
    import ray

    start_local_ray()
    yield
    ray.shutdown()


def loopback_cluster(patch):
    """Generator for fixtures: a head and a worker node of 1 CPU each (ray.cluster_utils.Cluster, loopback
    only), yielded; the tests' usual local Ray is restored afterwards. `patch`: a pytest MonkeyPatch."""
    import ray
    import ray._private.services as ray_services
    from ray.cluster_utils import Cluster

    was_up = ray.is_initialized()
    ray.shutdown()
    # Added nodes look for the head at the machine's address unless this says loopback.
    patch.setattr(ray_services, "get_node_ip_address", lambda *a, **k: "127.0.0.1")
    patch.setenv("PYTHONPATH", TESTS_DIR, prepend=":")  # raylets pass it on to workers
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if was_up:
        start_local_ray()


@pytest.fixture
def isolated_registries():
    """Restore every `Registry`'s entries after the test."""
    registries = [r for r in gc.get_objects() if isinstance(r, Registry)]
    for registry in registries:  # built-ins that register on first lookup: in the snapshot, not lost with it
        registry.names()
    saved = [(r, dict(r._entries)) for r in registries]
    yield
    for registry, entries in saved:
        registry._entries.clear()
        registry._entries.update(entries)
