"""Weight sync: load the training engine's weights into a rollout in the same process.

The first sync loads every weight. With LoRA adapters later syncs may send only the
adapted layers' merged weights (`changed_only`): the frozen rest is already in place.

A rollout split over tensor-parallel ranks (`Rollout.generation_layout`) gets only its generation
shard: the engine's training shards are resharded to it (hybridflow/engine/reshard.py), moving only the
pieces each rank lacks, instead of gathering the full model on every rank. LoRA keeps the full
gather of merged weights (the rollout takes its chunk of each).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hybridflow.engine.reshard import GenerationLayout, ReshardStats, named_weights, reshard

if TYPE_CHECKING:
    from hybridflow.engine.base import Engine
    from hybridflow.rollout.base import Rollout


def load_state_dict_into(model: nn.Module, state_dict: dict[str, Tensor], partial: bool = False) -> None:
    """Copy every tensor of `state_dict` in place into `model`, cast to the model's dtype.

    Keys must be the model's own `state_dict()` keys. Tied parameters (e.g. lm_head and
    the input embedding) are written once; the state dict may hold either or both names.
    `partial`: the state dict may hold any subset of the weights; the others are kept.
    Raises KeyError for unknown or (unless `partial`) missing keys, ValueError for a shape mismatch.
    """
    targets = model.state_dict(keep_vars=True)
    unknown = sorted(set(state_dict) - set(targets))
    if unknown:
        raise KeyError(
            f"load_weights: {len(unknown)} keys are not in the rollout model, e.g. {unknown[:3]}; "
            f"expected keys like {list(targets)[:3]} (strip wrapper prefixes such as '_orig_mod.')"
        )
    written: set[int] = set()
    with torch.no_grad():
        for key, src in state_dict.items():
            dst = targets[key]
            if id(dst) in written:
                continue
            if dst.shape != src.shape:
                raise ValueError(
                    f"load_weights: {key} has shape {tuple(src.shape)}, the rollout model expects {tuple(dst.shape)}"
                )
            dst.copy_(src)
            written.add(id(dst))
    missing = [k for k, t in targets.items() if id(t) not in written]
    if missing and not partial:
        raise KeyError(
            f"load_weights: the state dict lacks {len(missing)} of the model's keys, e.g. "
            f"{missing[:3]}; pass the engine's full state dict"
        )


def sync_weights(rollout: Rollout, engine: Engine, changed_only: bool = False) -> float:
    """Gather `engine`'s full weights in the rollout's dtype and load them; returns the seconds
    of both (the gather is a collective: every rank of the engine must call this).

    With a split rollout (`generation_layout()` not None) and no adapters, reshards instead (`reshard_into`).
    `changed_only` (once the rollout holds every weight): only those training can have changed,
    see `Engine.full_state_dict`. The caller reports the value as the metric `timing_s/weight_sync`.
    """
    start = time.perf_counter()
    layout = rollout.generation_layout()
    if layout is not None and not engine.has_adapters:
        reshard_into(rollout, engine, layout)
        return time.perf_counter() - start
    state = engine.full_state_dict(dtype=rollout.weight_dtype, changed_only=changed_only)
    rollout.load_weights(state, partial=changed_only and engine.has_adapters)  # without adapters it is all of them
    return time.perf_counter() - start


def reshard_into(rollout: Rollout, engine: Engine, layout: GenerationLayout, stats: ReshardStats | None = None) -> None:
    """Write this rank's generation shard of `engine`'s weights straight into the rollout's tensors
    (a collective over the engine's ranks; hybridflow/engine/reshard.py). `stats`: filled with the bytes moved."""
    reshard(named_weights(engine.module), layout, rollout.weight_dtype, out=rollout.shard_tensors(), stats=stats)
