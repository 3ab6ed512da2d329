"""Which `Engine` a role worker builds: one place to plug in another backend.

Role workers never name a backend class; they call `build_engine`, so a
GPU-specific engine is one more entry in `ENGINES`, not a
copy of a worker, selected by `engine.backend` (actor, critic, sft; `reward_model.backend`); `declare_engine_mesh` gives the worker its dp layout for the N-D dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.engine.base import Engine
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.engine.fsdp import FSDPEngine
from hybridflow.engine.parallel.dims import ParallelDims, check_divides
from hybridflow.utils.device import device_kind
from hybridflow.utils.registry import Registry, UnknownNameError


def _fsdp(
    path: str | Path, cfg: EngineConfig, optim: OptimConfig | None, value_model: bool, lora: LoraConfig | None
) -> Engine:
    return FSDPEngine.from_pretrained(path, cfg, optim, value_model=value_model, lora=lora)


EngineBuilder = Callable[[str | Path, EngineConfig, OptimConfig | None, bool, LoraConfig | None], Engine]
"""(path, cfg, optim, value_model, lora) -> Engine: load the HF model at `path` on this process group (optim None:
inference only; value_model: a value head instead of the LM head; lora with rank > 0: train adapters)."""

ENGINES: Registry[EngineBuilder] = Registry(
    "engine backend",
    "engine.backend",
    "add one with hybridflow.workers.engines.ENGINES.register(name, build_fn) in a trainer.plugins module, "
    "or give a module:function path",
)
"""Engine backends by name (config: actor.engine.backend, critic.engine.backend, reward_model.backend)."""
ENGINES.register("fsdp", _fsdp)
# One engine for every layout (engine/parallel/parallelize.py); the names a layout used to pick stay valid.
ENGINES.register("fsdp_tp", _fsdp)
ENGINES.register("fsdp_sp", _fsdp)


def engine_backend(cfg: EngineConfig) -> str:
    """The backend name `cfg` selects: cfg.backend, or from the layout when it is None."""
    if cfg.backend is not None:
        return cfg.backend
    if cfg.tensor_parallel_size > 1:
        return "fsdp_tp"
    return "fsdp_sp" if cfg.ulysses_sequence_parallel_size > 1 else "fsdp"


def check_engine_backend(section: str, cfg: EngineConfig) -> None:
    """Raise ValueError naming `section`.backend when it names no registered (or loadable) engine backend."""
    try:
        ENGINES.get(engine_backend(cfg))
    except UnknownNameError:
        raise ValueError(
            f"{section}.backend={cfg.backend!r} is not a registered engine backend; known: {ENGINES.names()} "
            "(or a module:function path; register one in a trainer.plugins module)"
        ) from None


def build_engine(
    path: str | Path,
    cfg: EngineConfig,
    optim: OptimConfig | None = None,
    value_model: bool = False,
    backend: str | None = None,
    lora: LoraConfig | None = None,
) -> Engine:
    """Load the model at `path` into the engine backend `backend` (None: `cfg.backend`, itself None: chosen from
    the layout, see `engine_backend`); optim=None: inference only; `lora` with rank > 0: train adapters on a
    causal LM instead of its weights."""
    return ENGINES.get(backend or engine_backend(cfg))(path, cfg, optim, value_model, lora)


def declare_engine_mesh(worker: Any, mesh_name: str, cfg: EngineConfig, section: str) -> int:
    """Declare `worker`'s place on the pp x dp x (sp x tp) layout of `cfg` for the N-D dispatch under `mesh_name`:
    the pp/sp/tp ranks of a dp group receive its rows and the first sp/tp rank of its last pipeline stage is collected.
    Returns the dp size; raises ValueError (naming `section`, e.g. "actor.engine.") when tp x sp x pp does not divide
    the world."""
    tp, sp, pp = cfg.tensor_parallel_size, cfg.ulysses_sequence_parallel_size, cfg.pipeline_model_parallel_size
    check_divides(worker.world_size, tp, sp, section, pp=pp)
    dims = ParallelDims.from_config(cfg, worker.world_size, device_kind(), section)
    worker._register_dispatch_collect_info(mesh_name, dims.coords(worker.rank).dp, dims.is_collect(worker.rank))
    return dims.dp
