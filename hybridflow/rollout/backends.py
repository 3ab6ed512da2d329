"""Rollout backends by name (config: rollout.name): a registry of specs, each a builder plus what the config
checks need to know (tensor parallel, LoRA sync, the package it needs and how to install it).

    ROLLOUT_BACKENDS.register("mine", RolloutBackendSpec(build=my_builder))

A builder has the signature `RolloutBuilder`; it runs in the worker process (after `trainer.plugins` are
imported there) and returns a `Rollout`. A `module:function` rollout.name loads a builder (or a spec) by path.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from hybridflow.rollout.base import Rollout, load_rollout_model, tensor_parallel_group
from hybridflow.rollout.config import RolloutConfig
from hybridflow.rollout.hf import HFRollout
from hybridflow.rollout.native.rollout import NativeRollout
from hybridflow.rollout.vllm.engine import installed_vllm_device
from hybridflow.rollout.vllm.rollout import VLLMRollout
from hybridflow.utils.registry import Registry

RolloutBuilder = Callable[[RolloutConfig, "str | os.PathLike | nn.Module", Any, int], Rollout]
"""(config, model_path_or_module, tokenizer, tp_stride) -> Rollout. `model_path_or_module` is an HF directory
or an in-process module; `tp_stride` is how far apart the ranks of a tensor-parallel group are."""


@dataclass(frozen=True)
class RolloutBackendSpec:
    """A rollout backend and the facts the config checks at load."""

    build: RolloutBuilder
    """Builds the backend in the worker process (signature: `RolloutBuilder`)."""
    supports_tensor_parallel: bool = False
    """It honours rollout.tensor_model_parallel_size > 1."""
    supports_lora_sync: bool = True
    """It accepts a LoRA actor's partial weight sync (only the adapted layers)."""
    package: str | None = None
    """Import name of a package it needs, checked at load (None: nothing beyond hybridflow's dependencies)."""
    install_hint: str = ""
    """How to install `package`, for the error message."""
    installed_device: Callable[[], str | None] | None = None
    """The device the installed package build runs on ("cpu"/"cuda"), checked against trainer.device; None: any."""

    def check_installed(self, name: str, device: str) -> None:
        """Raise ValueError naming rollout.name when the package is missing or built for another device."""
        if self.package is not None and importlib.util.find_spec(self.package) is None:
            raise ValueError(
                f"rollout.name={name} needs the {self.package} package, which is not installed; "
                f"{self.install_hint}; or use rollout.name=native"
            )
        build = self.installed_device() if self.installed_device is not None else None
        if build is not None and build != device:
            raise ValueError(
                f"rollout.name={name}: the installed {self.package} build runs on {build}, but "
                f"trainer.device={device}; set trainer.device={build} or install the {self.package} build for {device}"
            )


def _as_spec(entry: Any) -> RolloutBackendSpec:
    """A `module:attr` path may name a spec or a bare builder."""
    return entry if isinstance(entry, RolloutBackendSpec) else RolloutBackendSpec(build=entry)


ROLLOUT_BACKENDS: Registry[RolloutBackendSpec] = Registry(
    "rollout backend",
    "rollout.name",
    "add one with hybridflow.rollout.ROLLOUT_BACKENDS.register(name, RolloutBackendSpec(build=...)) in a "
    "trainer.plugins module, or give a module:function path",
    wrap=_as_spec,
)
"""Rollout backend specs by name."""


def _native(config: RolloutConfig, model: str | os.PathLike | nn.Module, tokenizer: Any, tp_stride: int) -> Rollout:
    tp = config.tensor_model_parallel_size
    group = tensor_parallel_group(tp, tp_stride) if tp > 1 else None
    loaded = load_rollout_model(model, config.torch_dtype)
    return NativeRollout(config, loaded, tokenizer, tp_group=group, tp_stride=tp_stride)


def _hf(config: RolloutConfig, model: str | os.PathLike | nn.Module, tokenizer: Any, tp_stride: int) -> Rollout:
    return HFRollout(config, load_rollout_model(model, config.torch_dtype), tokenizer)


def _vllm(config: RolloutConfig, model: str | os.PathLike | nn.Module, tokenizer: Any, tp_stride: int) -> Rollout:
    return VLLMRollout(config, model, tokenizer)


def _vllm_device() -> str | None:
    return installed_vllm_device()


ROLLOUT_BACKENDS.register("native", RolloutBackendSpec(_native, supports_tensor_parallel=True))
ROLLOUT_BACKENDS.register("hf", RolloutBackendSpec(_hf))
ROLLOUT_BACKENDS.register(
    "vllm",
    RolloutBackendSpec(
        _vllm,
        supports_lora_sync=False,  # its sync sends only the adapted layers, and vllm reloads whole layers
        package="vllm",
        install_hint="on CPU run ./scripts/setup.sh --vllm and use .venv-vllm/bin/hybridflow, on a GPU pip "
        "install 'hybridflow[vllm]'",
        installed_device=_vllm_device,
    ),
)


def check_backend(config: RolloutConfig) -> RolloutBackendSpec:
    """The backend `config.name` names, checked against what `config` asks of it (run configs call this at load).
    Unknown names (or unloadable paths) fail naming rollout.name."""
    spec = ROLLOUT_BACKENDS.get(config.name)
    if config.tensor_model_parallel_size > 1 and not spec.supports_tensor_parallel:
        raise ValueError(
            f"rollout.tensor_model_parallel_size > 1 is not supported by rollout.name={config.name!r}; "
            "use rollout.name=native"
        )
    return spec


def build_rollout(
    config: RolloutConfig, model_path_or_module: str | os.PathLike | nn.Module, tokenizer: Any, tp_stride: int = 1
) -> Rollout:
    """The rollout backend registered as `config.name` (or loaded from its module:function path); `tp_stride`:
    how far apart the ranks of a tensor-parallel group are (see `tensor_parallel_group`)."""
    return check_backend(config).build(config, model_path_or_module, tokenizer, tp_stride)
