"""The Ray backend: placement-group resource pools and actor worker groups."""

from __future__ import annotations

from typing import Any

import ray

from hybridflow.controller.colocate import create_colocated_worker_cls, create_colocated_worker_cls_fused
from hybridflow.controller.ray.pool_manager import ResourcePoolManager
from hybridflow.controller.ray.resource_pool import (
    RayClassWithInitArgs,
    RayResourcePool,
    SubRayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)
from hybridflow.controller.ray.start import RayStartTimeout, start_ray
from hybridflow.controller.ray.worker_group import RayWorkerGroup

__all__ = [
    "RayClassWithInitArgs",
    "RayStartTimeout",
    "RayResourcePool",
    "RayWorkerGroup",
    "SubRayResourcePool",
    "ResourcePoolManager",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "init_local_ray",
    "merge_resource_pool",
    "split_resource_pool",
]


def init_local_ray(num_cpus: int | None = None, start_timeout_s: float = 180.0, **kwargs: Any) -> None:
    """Start a fresh single-node Ray on loopback (no-op when Ray is already up).

    `address="local"` never attaches to a stale cluster; extra `kwargs` go to `ray.init`. Ray's node-startup
    timeout is retried for up to `start_timeout_s` in all (controller/ray/start.py), then `RayStartTimeout`.
    """
    if ray.is_initialized():
        return
    options = {"address": "local", "_node_ip_address": "127.0.0.1", "include_dashboard": False}
    start_ray(ray.init, start_timeout_s, num_cpus=num_cpus, **{**options, **kwargs})
