"""verl's RayWorkerGroup methods: raw calls by method name, actor names and attaching to detached workers.

`RayWorkerGroup` inherits `VerlRayGroupMixin`; the mixin uses the group's `_workers`, `_worker_names`
and `_world_size`. See docs/verl_runtime.md for where these depart from verl.
"""

from __future__ import annotations

from typing import Any

import ray

DEVICE_NAMES = ("cuda", "cpu")
"""`device_name`s a RayWorkerGroup accepts (verl's "npu" has no backend here)."""


def check_device_name(device_name: str) -> str:
    """`device_name` if hybridflow can run it, else a ValueError."""
    if device_name not in DEVICE_NAMES:
        raise ValueError(
            f"RayWorkerGroup(device_name={device_name!r}): hybridflow runs on {' or '.join(DEVICE_NAMES)}; "
            "the resource pool's use_gpu decides which"
        )
    return device_name


def merge_worker_env(system_env: dict[str, str], worker_env: dict[str, str] | None) -> dict[str, str]:
    """The group's own env plus verl's `worker_env`, which may not redefine any of the group's variables."""
    worker_env = dict(worker_env or {})
    clash = sorted(set(system_env) & set(worker_env))
    if clash:
        raise ValueError(f"RayWorkerGroup(worker_env=...): cannot override the group's own variables {clash}")
    return {**system_env, **{k: str(v) for k, v in worker_env.items()}}


def _per_worker(length: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]] | None:
    """verl's rule: when every argument is a list of `length`, worker i gets element i of each."""
    values = [*args, *kwargs.values()]
    if not all(isinstance(v, list) and len(v) == length for v in values):
        return None
    return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(length)]


class VerlRayGroupMixin:
    """verl's raw-call API of a RayWorkerGroup (object refs, no dispatch, no call timeout)."""

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Start `method_name` on every worker; returns their object refs in rank order. When every
        argument is a list with one element per worker, worker i gets the i-th elements; otherwise
        every worker gets the arguments as given."""
        split = _per_worker(len(self._workers), args, kwargs)
        if split is None:
            return [getattr(w, method_name).remote(*args, **kwargs) for w in self._workers]
        return [getattr(w, method_name).remote(*a, **k) for w, (a, k) in zip(self._workers, split)]

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Same as `execute_all_async`."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Start `method_name` on rank 0 only; returns its object ref."""
        return getattr(self._workers[0], method_name).remote(*args, **kwargs)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Same as `execute_rank_zero_async`."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method_name` on rank 0 and return its output."""
        return ray.get(self.execute_rank_zero_async(method_name, *args, **kwargs))

    @property
    def worker_names(self) -> list[str]:
        """The Ray actor names of the workers, in rank order (for `from_detached`).

        Only a group built with `detached=True` names its actors; any other raises RuntimeError.
        """
        if not self._worker_names:
            raise RuntimeError(
                f"worker group {self._name}: its actors have no names; build it with detached=True to name them"
            )
        return list(self._worker_names)

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: list[str] | None = None,
        worker_handles: list[Any] | None = None,
        ray_cls_with_init: Any = None,
        **kwargs: Any,
    ) -> Any:
        """A group driving already running (detached) workers, found by `worker_handles` or by
        `worker_names`; `ray_cls_with_init` binds their class's registered methods. `kwargs`:
        `poll_interval_s`, `timeouts` as for the constructor."""
        if worker_handles is None:
            if not worker_names:
                raise ValueError("from_detached needs worker_names or worker_handles")
            worker_handles = [ray.get_actor(name) for name in worker_names]
        return cls._attach(name_prefix, list(worker_handles), list(worker_names or []), ray_cls_with_init, **kwargs)
