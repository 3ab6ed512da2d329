"""Several worker classes fused into one process per device.

`create_colocated_worker_cls({"actor": A, "critic": B})` builds a Worker
class whose instance holds one `A` and one `B` and exposes their registered
methods as `actor_<name>` / `critic_<name>`; the roles' Ray actor options
(`ClassWithInitArgs.ray_options`) become the fused worker's. Build ONE worker group from it,
then `group.spawn({"actor", "critic"})` gives one group per role; both drive
the same processes, so the roles share memory, devices and process groups.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hybridflow.controller.decorator import REGISTER_ATTR, MethodSpec
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import registered_methods


def _forwarder(role: str, name: str, spec: MethodSpec, is_async: bool = False) -> Callable:
    if is_async:  # an async role method stays async, so the fused worker awaits it

        async def forward(self, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.workers[role], name)(*args, **kwargs)
    else:

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.workers[role], name)(*args, **kwargs)

    forward.__name__ = f"{role}_{name}"
    setattr(forward, REGISTER_ATTR, spec)
    return forward


def create_colocated_worker_cls(class_dict: dict[str, type | ClassWithInitArgs]) -> ClassWithInitArgs:
    """A ClassWithInitArgs of a fused worker class hosting every role in one process.

    `class_dict` maps a role name (the method prefix) to a worker class or a
    ClassWithInitArgs. The role objects are built in the fused worker's
    `__init__`, in the order given, under the same RANK/WORLD_SIZE environment.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles = {role: c if isinstance(c, ClassWithInitArgs) else ClassWithInitArgs(c) for role, c in class_dict.items()}
    bad = [r for r in roles if not r.isidentifier()]
    clash = [(a, b) for a in roles for b in roles if a != b and b.startswith(f"{a}_")]
    if bad or clash:
        raise ValueError(
            f"role names become method prefixes: they must be identifiers ({bad} are not) and no role "
            f"may start with another role plus '_' ({clash} do)"
        )

    def __init__(self) -> None:
        Worker.__init__(self)
        self.workers = {role: cwa() for role, cwa in roles.items()}

    namespace: dict[str, Any] = {"__init__": __init__, "__doc__": f"Colocated roles {list(roles)}."}
    for role, cwa in roles.items():
        for name, spec in registered_methods(cwa.cls).items():
            is_async = inspect.iscoroutinefunction(getattr(cwa.cls, name))
            namespace[f"{role}_{name}"] = _forwarder(role, name, spec, is_async)
    fused = ClassWithInitArgs(type("Colocated_" + "_".join(roles), (Worker,), namespace))
    fused.ray_options = _merged_ray_options(roles)
    return fused


def _merged_ray_options(roles: dict[str, ClassWithInitArgs]) -> dict[str, Any]:
    """The roles' Ray actor options, for their one shared process; roles may not disagree on a value."""
    merged: dict[str, Any] = {}
    for role, cwa in roles.items():
        for key, value in cwa.ray_options.items():
            if merged.setdefault(key, value) != value:
                raise ValueError(
                    f"colocated roles share one Ray actor but disagree on its option {key!r}: "
                    f"role {role!r} wants {value!r}, an earlier role {merged[key]!r}"
                )
    return merged


def create_colocated_worker_cls_fused(class_dict: dict[str, type | ClassWithInitArgs]) -> ClassWithInitArgs:
    """verl's name for a fused worker class: the same as `create_colocated_worker_cls` here (one worker
    group from it, then `spawn(prefix_set)` or `fuse(prefix_set)` for one group per role)."""
    return create_colocated_worker_cls(class_dict)
