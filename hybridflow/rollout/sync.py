"""Weight sync: load the training engine's weights into a rollout in the same process.

The first sync loads every weight. With LoRA adapters later syncs may send only the
adapted layers' merged weights (`changed_only`): the frozen rest is already in place.

A rollout split over tensor-parallel ranks (`Rollout.generation_layout`) gets only its generation
shard: the engine's training shards are resharded to it (hybridflow/engine/reshard.py), moving only the
pieces each rank lacks, instead of gathering the full model on every rank. That holds for any training
layout, pipeline stages included (pp x tp x dp: a weight comes from the ranks of the stage that holds it;
`weight_table`). LoRA keeps the full gather of merged weights (the rollout takes its chunk of each).

When the engine holds every weight whole, in the rollout's dtype and on its device (one training rank, e.g.
the 1x2 layout on CPU in fp32), the rollout generates with the engine's own tensors instead of a copy
(`Rollout.share_weights`): the sync moves nothing and the rollout's copy is freed (SmolLM2 in fp32: 540 MB).
There is then nothing a sync could get wrong, and nothing to fingerprint. A test that breaks syncs keeps the copy
(`KEEP_COPY`), which is what its faults break.

With `check`, every sync is verified (hybridflow/parity/weights.py): the fingerprints of what the engine meant
to send against those of what the rollout holds afterwards; a mismatch is a finding in the `SyncReport`. The
hook points below (hybridflow/utils/hooks.py) are where tests break a sync to show the check finds it; the
weight bridge (workers/actor_rollout_ref.py) calls them too, with path "bridge".
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from hybridflow.engine.gather import TIED_HEAD
from hybridflow.engine.reshard import GenerationLayout, ReshardStats, named_weights, reshard
from hybridflow.engine.reshard_plan import WeightTable, gathered_table
from hybridflow.parity.weights import SyncSite, WeightCheck, expected_shard_prints, gather_findings
from hybridflow.rollout.base import Rollout
from hybridflow.utils.hooks import HookPoint

if TYPE_CHECKING:
    from hybridflow.engine.base import Engine

KEEP_COPY = HookPoint(
    "weight_sync.keep_copy",
    "asked before a rollout would generate with the engine's own tensors: (rollout, engine); True keeps its copy",
)
BEFORE_LOAD = HookPoint(
    "weight_sync.before_load",
    "a full or bridge sync is about to load `state` (already fingerprinted as sent): (state, rollout, engine, step, "
    "path), engine None on the bridge's receiving side; answers a state dict to load instead, or None",
)
SKIP_LOAD = HookPoint(
    "weight_sync.skip_load",
    "asked before every sync's load: (rollout, step, path); True: nothing is loaded, the rollout keeps its weights",
)
RESHARD_LAYOUT = HookPoint(
    "weight_sync.reshard_layout",
    "a reshard is about to write the rollout's shards: (layout, step); a GenerationLayout to use instead, or None",
)
LOADED = HookPoint(
    "weight_sync.loaded",
    "after every sync's load (skipped or not), before the check: (rollout, step, path); the hook may alter the "
    "rollout's tensors in place",
)


@dataclass
class SyncReport:
    """What one `sync_weights` did."""

    seconds: float = 0.0
    """The whole sync (gather or reshard, load, check): the metric timing_s/weight_sync."""
    check_seconds: float = 0.0
    """Of which fingerprinting both sides: the metric timing_s/parity_weights."""
    findings: list[str] = field(default_factory=list)
    """The weight-sync parity findings (keys.META_PARITY lines); empty when the rollout holds what was sent."""
    shared: bool = False
    """The rollout generates with the engine's own tensors (nothing was copied or checked)."""


def share_engine_weights(rollout: Rollout, engine: Engine) -> bool:
    """Point the rollout at the engine's own tensors where it can (module docstring); whether it now does."""
    if rollout.generation_layout() is not None or engine.has_adapters or KEEP_COPY(rollout=rollout, engine=engine):
        return False
    if engine.pipeline_stages > 1:  # a stage holds part of the model
        return False
    tensors = engine_tensors(engine)
    return tensors is not None and rollout.share_weights(tensors)


def engine_tensors(engine: Engine) -> dict[str, Tensor] | None:
    """The engine's parameter tensors by name (tied ones under each name) when this rank holds each whole, else
    None. A DTensor over one rank (FSDP on one process) counts: its local tensor is the whole weight."""
    out = {}
    for name, p in named_weights(engine.module).items():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.shape != p.shape:
            return None
        out[name] = local
    return out


def sync_weights(
    rollout: Rollout,
    engine: Engine,
    changed_only: bool = False,
    step: int | None = None,
    check: bool = False,
    backend: str = "",
    share: bool = True,
) -> SyncReport:
    """Gather `engine`'s full weights in the rollout's dtype and load them (the gather is a collective: every
    rank of the engine must call this).

    With a split rollout (`generation_layout()` not None) and no adapters, reshards instead (`reshard_into`).
    `changed_only` (once the rollout holds every weight): only those training can have changed,
    see `Engine.full_state_dict`. `step`: the training step the weights are for (findings and hook points name it);
    `check`: fingerprint both sides (rollout.weight_fingerprints), `backend` (rollout.name) named in findings.
    `share`: let the rollout generate with the engine's own tensors where it can (module docstring); False copies.
    """
    start = time.perf_counter()
    layout = rollout.generation_layout()
    if share and share_engine_weights(rollout, engine):
        return SyncReport(time.perf_counter() - start, 0.0, [], shared=True)
    resharded = layout is not None and not engine.has_adapters
    path = "reshard" if resharded else "lora" if engine.has_adapters else "colocated"
    site = SyncSite(backend, path, step, None if layout is None else dist.get_rank())
    check_ = WeightCheck(rollout, site, check)
    rollout.sync_step = step
    if resharded:
        findings = _reshard_sync(rollout, engine, layout, step, check_)
    else:
        findings = _full_sync(rollout, engine, changed_only, step, check_)
    if layout is not None and check_.enabled:  # ranks hold different shards; only some ranks' outputs are collected
        findings = gather_findings(findings)
    return SyncReport(time.perf_counter() - start, check_.seconds, findings)


def _full_sync(rollout: Rollout, engine: Engine, changed_only: bool, step: int | None, check: WeightCheck) -> list[str]:
    path = "lora" if engine.has_adapters else "colocated"
    state = engine.full_state_dict(dtype=rollout.weight_dtype, changed_only=changed_only)
    sent = check.sent(state)
    replaced = BEFORE_LOAD(state=state, rollout=rollout, engine=engine, step=step, path=path)
    if not SKIP_LOAD(rollout=rollout, step=step, path=path):
        partial = changed_only and engine.has_adapters  # without adapters: all of them
        rollout.load_weights(state if replaced is None else replaced, partial=partial)
    LOADED(rollout=rollout, step=step, path=path)
    return check.compare(sent)


def _reshard_sync(
    rollout: Rollout, engine: Engine, layout: GenerationLayout, step: int | None, check: WeightCheck
) -> list[str]:
    named, table = named_weights(engine.module), weight_table(engine)
    expected = check.timed(expected_shard_prints, named, layout, rollout.weight_dtype, table)
    layout = RESHARD_LAYOUT(layout=layout, step=step) or layout
    if not SKIP_LOAD(rollout=rollout, step=step, path="reshard"):
        reshard_into(rollout, engine, layout)
    LOADED(rollout=rollout, step=step, path="reshard")
    return check.compare(expected)


def reshard_into(rollout: Rollout, engine: Engine, layout: GenerationLayout, stats: ReshardStats | None = None) -> None:
    """Write this rank's generation shard of `engine`'s weights straight into the rollout's tensors
    (a collective over the engine's ranks; hybridflow/engine/reshard.py). `stats`: filled with the bytes moved."""
    named, out = named_weights(engine.module), rollout.shard_tensors()
    reshard(named, layout, rollout.weight_dtype, out=out, stats=stats, table=weight_table(engine))


_TABLES: weakref.WeakKeyDictionary[Engine, WeightTable] = weakref.WeakKeyDictionary()
"""Each pipelined engine's reshard table: its layout never changes, so it is exchanged once."""


def weight_table(engine: Engine) -> WeightTable | None:
    """The reshard's table of `engine`'s weights where its ranks hold different weights (pipeline stages): built at
    the first call (`gathered_table`, a collective: every rank of the engine calls it, as every sync), then kept
    for the engine's life. None without stages: each rank reads the table off its own weights."""
    if engine.pipeline_stages == 1:
        return None
    if engine not in _TABLES:
        aliases = TIED_HEAD if getattr(engine.module, "tied", False) else {}  # PipelineStageModule.tied
        _TABLES[engine] = gathered_table(named_weights(engine.module), aliases)
    return _TABLES[engine]
