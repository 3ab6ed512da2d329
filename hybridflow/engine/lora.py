"""LoRA adapters (Hu et al. 2021) on an engine's causal LM, through peft.

The engine wraps the HF model with `peft.get_peft_model` BEFORE FSDP2 shards it, so every
decoder layer (found inside the wrapper) is still one FSDP unit, now holding its adapters.
Only adapter parameters require grad: the optimizer, the gradient norm and checkpoints
(`ignore_frozen_params`) cover them alone.

Outside the engine the adapters never show: `merged_state_dict` gives the weights that the
rollout, exports and `Engine.full_state_dict` see, W + (alpha / r) * B @ A under the base
model's HF names. Each rank merges its own rows of W (W and B are both sharded over their
output rows, A is gathered whole: it is r rows) in fp32, and only the merged rows are
gathered, in the rollout's dtype: merging costs no more traffic than a plain gather.
"""

from __future__ import annotations

from collections import Counter

import peft
import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.engine.config import LoraConfig
from hybridflow.engine.gather import detached_full, gather_named, tied_aliases

PEFT_PREFIX = "base_model.model."
"""What `get_peft_model` puts in front of every name of the wrapped HF model."""
ADAPTER = "default"
"""The name of the one adapter peft holds."""
INIT_SEED = 0
"""Seed of the adapters' random init (A; B starts at 0)."""


def peft_config(cfg: LoraConfig) -> peft.LoraConfig:
    """The peft config of `cfg` (no bias training, plain alpha / r scaling)."""
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=cfg.target_modules,
        lora_dropout=cfg.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, cfg: LoraConfig) -> peft.PeftModel:
    """`model` wrapped with fresh adapters (B = 0: the adapted model starts equal to the base).

    A is drawn from a fixed seed: every rank must start from the same adapters (with fsdp_size=1
    each holds all of them, and replicas that differ would train different models), and runs repeat.
    """
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            wrapped = peft.get_peft_model(model, peft_config(cfg))
    except ValueError as err:
        raise ValueError(
            f"lora.target_modules={cfg.target_modules!r} does not fit {type(model).__name__}: {err}"
        ) from None
    _check_adapted(wrapped)
    return wrapped


def _check_adapted(model: nn.Module) -> None:
    """Refuse adapters the merge cannot express: on non-linear layers, or on a weight tied to another."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for name, layer in adapted_layers(model):
        if not isinstance(layer, LoraLinear):
            raise ValueError(
                f"lora.target_modules: {hf_name(name)} is of type {type(layer.base_layer).__name__}; "
                "adapters are supported on linear layers only"
            )
        if uses[id(layer.base_layer.weight)] > 1:
            raise ValueError(
                f"lora.target_modules: {hf_name(name)} shares its weight with another layer (tied "
                "embeddings); leave it out"
            )


def adapted_layers(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    """(name, layer) of every layer carrying an adapter, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def hf_name(name: str) -> str:
    """The base model's HF name of a peft parameter or module name."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").removesuffix(".base_layer")


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names an adapter tensor (lora_A / lora_B ...), not a base weight."""
    return any(part in LoraLayer.adapter_layer_names for part in key.split("."))


def merged_state_dict(model: nn.Module, dtype: torch.dtype | None, changed_only: bool) -> dict[str, torch.Tensor]:
    """Full merged weights under HF names (see module docstring); `changed_only`: the adapted layers' only.

    Collective over the model's mesh: every rank must call it.
    """
    layers = adapted_layers(model)
    named = {hf_name(f"{name}.weight"): _merged_rows(layer, dtype) for name, layer in layers}
    if not changed_only:
        merged = {f"{name}.base_layer.weight" for name, _ in layers}
        named.update(
            {hf_name(k): t for k, t in model.state_dict().items() if k not in merged and not is_adapter_key(k)}
        )
    # a merged (adapted) head is a new tensor, not the embedding's storage: tied_aliases leaves it out
    return gather_named(named, dtype, tied_aliases(getattr(model, "config", None), named))


def _merged_rows(layer: LoraLinear, dtype: torch.dtype | None) -> torch.Tensor:
    """This rank's rows of W + s * B @ A, merged in fp32, in `dtype`; a DTensor sharded like W when W is one."""
    weight = layer.base_layer.weight.detach()
    a_full = detached_full(layer.lora_A[ADAPTER].weight).float()
    b_rows = _local(layer.lora_B[ADAPTER].weight.detach()).float()
    rows = (_local(weight).float() + layer.scaling[ADAPTER] * (b_rows @ a_full)).to(dtype or weight.dtype)
    if not isinstance(weight, DTensor):
        return rows
    return DTensor.from_local(
        rows, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
