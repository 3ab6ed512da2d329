"""The single-controller runtime: one controller process drives SPMD worker groups.

Backend-agnostic pieces live here (`decorator`, `worker`, `worker_group`,
`resource_pool`, `colocate`); `ray/` and `local.py` are the backends. Nothing
in this package knows about RL or models.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Worker": "hybridflow.controller.worker",
    "WorkerGroup": "hybridflow.controller.worker_group",
    "ClassWithInitArgs": "hybridflow.controller.resource_pool",
    "ResourcePool": "hybridflow.controller.resource_pool",
}
"""verl's `verl.single_controller.base` names, loaded on first use (this package stays cheap to import)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridflow.controller' has no attribute {name!r}")
