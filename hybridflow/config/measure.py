"""The measure stage: what resolve needs to know of the machine, measured (or read from caches) before it.

    cfg = load_config(RunConfig, yaml, overrides)    # user values (None / "auto" = derive), checked at load
    measured = measure(cfg)                          # this machine: CPUs, GPUs, dtype probe, device profiles
    run = resolve(cfg, steps_per_epoch, measured)    # pure: every derived value, no I/O, prints nothing

Only what the config leaves to the machine is measured: the matmul probe behind compute dtypes left
"auto" (hybridflow/utils/hardware.py, cached per machine) at every thread count a worker may get, and,
for trainer.n_workers_per_node=null (CPU search) or trainer.placement=auto (sync), the planner's device
profile at each candidate thread count (trainer.device_profile, else measured once and cached:
planner/auto.py) with the policy's parameter count. A config `--print-config` printed leaves nothing to
the machine, so loading it back measures nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybridflow.config.run import RunConfig
from hybridflow.config.trainer import JobConfig
from hybridflow.models import resolve_model_path
from hybridflow.planner.auto import ProfileSpec, cached_device_profiles, has_collectives
from hybridflow.planner.device import DeviceProfile
from hybridflow.planner.search import model_params
from hybridflow.utils.dtypes import AUTO, DTYPES
from hybridflow.utils.hardware import auto_compute_dtype


@dataclass(frozen=True)
class Measurements:
    """What `measure` found; plain values that `resolve` reads (tests build them by hand)."""

    cpu_count: int
    """CPUs of this node (os.cpu_count())."""
    cuda_devices: int = 0
    """Visible CUDA devices (counted with trainer.device=cuda only)."""
    auto_dtypes: Mapping[int, str] = field(default_factory=dict)
    """Threads per worker -> the compute dtype "auto" stands for at that count ("bf16" / "fp32")."""
    device_profiles: Mapping[int, DeviceProfile] = field(default_factory=dict)
    """Threads per worker -> the planner's device profile at that count (auto layouts only)."""
    model_params: float = 0.0
    """Parameters of the policy model where a device profile prices collectives, else 0."""

    def dtype(self, name: str, threads: int) -> str:
        """`name`, with "auto" replaced by the measured choice at `threads` threads per worker."""
        if name != AUTO:
            return name
        if threads not in self.auto_dtypes:
            raise ValueError(f"the compute dtype auto was not measured at {threads} threads per worker")
        return self.auto_dtypes[threads]

    def profile(self, threads: int) -> DeviceProfile:
        """The device profile at `threads` threads per worker."""
        if threads not in self.device_profiles:
            raise ValueError(f"no device profile was measured at {threads} threads per worker")
        return self.device_profiles[threads]


def measure(cfg: RunConfig, cpu_count: int | None = None) -> Measurements:
    """Measure what `cfg` leaves to this machine (see the module docstring); `cpu_count` overrides os.cpu_count()."""
    t = cfg.trainer
    cores = cpu_count or os.cpu_count() or 1
    cuda = torch.cuda.device_count() if t.device == "cuda" else 0
    layouts = layout_candidates(cfg, cores, cuda)
    threads = {w: threads_per_worker(t, cores, w) for w in layouts}
    dtypes = probe_auto_dtypes(t.device, threads.values()) if AUTO in compute_dtypes(cfg) else {}
    if not needs_device_profile(cfg, cores):
        return Measurements(cores, cuda, dtypes)
    profiles = device_profiles(cfg, {threads[w]: c for w, c in layouts.items()}, dtypes)
    collectives = any(has_collectives(p) for p in profiles.values())
    params = model_params(cfg.model.path) if collectives else 0.0
    return Measurements(cores, cuda, dtypes, profiles, params)


def measure_dtypes(t: JobConfig, names: Iterable[str], cpu_count: int | None = None) -> Measurements:
    """The CPUs, and the dtype probe where one of `names` is "auto", for a run with trainer.n_workers_per_node
    set (SFT)."""
    cores = cpu_count or os.cpu_count() or 1
    threads = threads_per_worker(t, cores, t.n_workers_per_node or 1)
    return Measurements(cores, auto_dtypes=probe_auto_dtypes(t.device, [threads]) if AUTO in names else {})


def probe_auto_dtypes(device: str, threads: Iterable[int]) -> dict[int, str]:
    """The compute dtype "auto" stands for on `device` at each thread count (probed once per machine)."""

    return {n: auto_compute_dtype(device, n) for n in sorted(set(threads))}


def compute_dtypes(cfg: RunConfig) -> tuple[str, ...]:
    """Every compute dtype the run's config names (some may be "auto")."""
    return (
        cfg.actor.engine.param_dtype,
        cfg.critic.engine.param_dtype,
        cfg.rollout.dtype,
        cfg.ref.param_dtype,
        cfg.reward_model.param_dtype,
    )


def threads_per_worker(t: JobConfig, cores: int, workers: int) -> int:
    """trainer.cpus_per_worker, else this node's `cores` shared by its `workers` (at least 1)."""
    return t.cpus_per_worker or max(1, cores // workers)


def with_workers(cfg: RunConfig, workers: int) -> RunConfig:
    """`cfg` with trainer.n_workers_per_node set (every load-time check runs again on the result)."""
    return replace(cfg, trainer=replace(cfg.trainer, n_workers_per_node=workers))


def needs_search(cfg: RunConfig, cores: int) -> bool:
    """Whether trainer.n_workers_per_node=null is chosen by the planner (CPU, Ray, threads left to choose)."""
    t = cfg.trainer
    return (
        t.n_workers_per_node is None
        and t.device != "cuda"
        and t.backend != "local"
        and cores > 1
        and not t.cpus_per_worker
    )


def needs_device_profile(cfg: RunConfig, cores: int) -> bool:
    """Whether resolving `cfg` asks the planner for predictions (which price a device profile)."""
    t = cfg.trainer
    return needs_search(cfg, cores) or (t.placement == "auto" and t.mode == "sync")


def layout_candidates(cfg: RunConfig, cores: int, cuda_devices: int) -> dict[int, RunConfig]:
    """Workers per node -> `cfg` with that many: the user's number; with trainer.n_workers_per_node=null
    one per GPU (cuda), 1 (the local backend or one core), cores // trainer.cpus_per_worker, else every
    divisor of `cores` whose layout the config checks accept (the planner picks one)."""
    t = cfg.trainer
    if t.n_workers_per_node is not None:
        return {t.n_workers_per_node: cfg}
    if not needs_search(cfg, cores):
        if t.device == "cuda":
            n = cuda_devices
        else:
            n = max(1, cores // t.cpus_per_worker) if t.cpus_per_worker and t.backend != "local" else 1
        return {n: with_workers(cfg, n)}
    accepted = {}
    for workers in [w for w in range(1, cores + 1) if cores % w == 0]:
        try:
            accepted[workers] = with_workers(cfg, workers)
        except ValueError:
            continue  # e.g. the mini-batch does not divide over this many workers
    if not accepted:
        raise ValueError(no_layout_message(cores))
    return accepted


def no_layout_message(cores: int) -> str:
    """The error when no split of the node fits the run."""
    return (
        f"trainer.n_workers_per_node=null: no split of {cores} cores into workers fits this run's "
        "batch sizes; set trainer.n_workers_per_node"
    )


def device_profiles(
    cfg: RunConfig, layouts: Mapping[int, RunConfig], auto_dtypes: Mapping[int, str]
) -> dict[int, DeviceProfile]:
    """Threads per worker -> the device profile of that layout (`layouts`: threads per worker -> `cfg` with its
    workers per node): trainer.device_profile for every layout, else the cached profiles of the run's model,
    missing ones measured together (planner/auto.py)."""
    if cfg.trainer.device_profile:
        loaded = DeviceProfile.load(Path(cfg.trainer.device_profile))
        return {threads: loaded for threads in layouts}
    model = resolve_model_path(cfg.model.path)
    specs = {threads: profile_spec(c, threads, auto_dtypes) for threads, c in layouts.items()}
    return dict(zip(specs, cached_device_profiles(model, list(specs.values()))))


def profile_spec(cfg: RunConfig, threads: int, auto_dtypes: Mapping[int, str]) -> ProfileSpec:
    """What `cfg`'s layout of `threads` threads per worker is profiled as: the actor's compute dtype, the rows one
    worker generates per thread, and one of the node's CPU workers running at once (a CUDA worker has its own
    device: measured alone)."""
    name = cfg.actor.engine.param_dtype
    dtype = DTYPES[auto_dtypes[threads] if name == AUTO else name]
    per_thread = max(1, cfg.data.train_batch_size * cfg.rollout.n // max(1, cfg.world_size * threads))
    workers = 1 if cfg.trainer.device == "cuda" else cfg.trainer.n_workers_per_node or 1
    return ProfileSpec(threads, dtype, per_thread, workers, collectives=cfg.world_size > 1)


def profile_dtype(cfg: RunConfig, threads: int) -> torch.dtype:
    """The dtype the run's actor computes in at `threads` threads ("auto" probed as the run will)."""
    name = cfg.actor.engine.param_dtype
    return DTYPES[probe_auto_dtypes(cfg.trainer.device, [threads])[threads] if name == AUTO else name]
