"""Which `Engine` a role worker builds: one place to plug in another backend.

Role workers never name a backend class; they call `build_engine`, so a tensor-
parallel or GPU-specific engine is one more entry in `ENGINES`, not a copy of a worker.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hybridflow.engine.base import Engine
from hybridflow.engine.config import EngineConfig, OptimConfig


def _fsdp(path: str | Path, cfg: EngineConfig, optim: OptimConfig | None, value_model: bool) -> Engine:
    from hybridflow.engine.fsdp import FSDPEngine

    return FSDPEngine.from_pretrained(path, cfg, optim, value_model=value_model)


ENGINES: dict[str, Callable[..., Engine]] = {"fsdp": _fsdp}
"""Engine backends by name."""


def build_engine(
    path: str | Path,
    cfg: EngineConfig,
    optim: OptimConfig | None = None,
    value_model: bool = False,
    backend: str = "fsdp",
) -> Engine:
    """Load the model at `path` into the `backend` engine (optim=None: inference only)."""
    if backend not in ENGINES:
        raise ValueError(f"unknown engine backend {backend!r}; valid: {sorted(ENGINES)}")
    return ENGINES[backend](path, cfg, optim, value_model)
