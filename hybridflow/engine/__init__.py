"""Engines: how one model trains and infers on its process group (FSDP2, and tensor or sequence parallel x FSDP2)."""

from hybridflow.engine.base import Engine, LossFn, MicroBatch
from hybridflow.engine.checkpoint import CheckpointError, export_adapter, export_hf, latest_checkpoint
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.engine.fsdp import FSDPEngine

__all__ = [
    "CheckpointError",
    "Engine",
    "EngineConfig",
    "FSDPEngine",
    "LoraConfig",
    "LossFn",
    "MicroBatch",
    "OptimConfig",
    "export_adapter",
    "export_hf",
    "latest_checkpoint",
]
