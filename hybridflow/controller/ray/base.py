"""verl's `verl.single_controller.ray.base` module path: the Ray backend's names, re-exported."""

from hybridflow.controller.colocate import create_colocated_worker_cls, create_colocated_worker_cls_fused
from hybridflow.controller.ray.resource_pool import (
    RayClassWithInitArgs,
    RayResourcePool,
    SubRayResourcePool,
    merge_resource_pool,
    split_resource_pool,
)
from hybridflow.controller.ray.worker_group import RayWorkerGroup

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "SubRayResourcePool",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "merge_resource_pool",
    "split_resource_pool",
]
