"""Which `Engine` a role worker builds: one place to plug in another backend.

Role workers never name a backend class; they call `build_engine`, so a tensor-
parallel or GPU-specific engine is one more entry in `ENGINES`, not a copy of a worker.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hybridflow.engine.base import Engine
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.utils.registry import Registry


def _fsdp(path: str | Path, cfg: EngineConfig, optim: OptimConfig | None, value_model: bool,
          lora: LoraConfig | None) -> Engine:
    from hybridflow.engine.fsdp import FSDPEngine

    return FSDPEngine.from_pretrained(path, cfg, optim, value_model=value_model, lora=lora)


def _fsdp_tp(path: str | Path, cfg: EngineConfig, optim: OptimConfig | None, value_model: bool,
             lora: LoraConfig | None) -> Engine:
    from hybridflow.engine.tensor_parallel import TensorParallelEngine

    return TensorParallelEngine.from_pretrained(path, cfg, optim, value_model=value_model, lora=lora)


ENGINES: Registry[Callable[[str | Path, EngineConfig, OptimConfig | None, bool, LoraConfig | None], Engine]] = Registry(
    "engine backend", "backend", "add one with hybridflow.workers.engines.ENGINES.register(name, build_fn)"
)
"""Engine backends by name: build_fn(path, cfg, optim, value_model, lora) -> Engine."""
ENGINES.register("fsdp", _fsdp)
ENGINES.register("fsdp_tp", _fsdp_tp)


def build_engine(
    path: str | Path,
    cfg: EngineConfig,
    optim: OptimConfig | None = None,
    value_model: bool = False,
    backend: str | None = None,
    lora: LoraConfig | None = None,
) -> Engine:
    """Load the model at `path` into the `backend` engine (optim=None: inference only; `lora` with
    rank > 0: train adapters on a causal LM instead of its weights). `backend` None: "fsdp_tp" when
    `cfg.tensor_parallel_size` > 1, else "fsdp"."""
    if backend is None:
        backend = "fsdp_tp" if cfg.tensor_parallel_size > 1 else "fsdp"
    return ENGINES.get(backend)(path, cfg, optim, value_model, lora)
