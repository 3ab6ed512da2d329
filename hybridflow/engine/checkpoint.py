"""Sharded, atomic engine checkpoints and HF exports.

Layout of a checkpoint directory (e.g. `ckpts/global_step_20`):
  *.distcp, .metadata   model + optimizer shards (torch.distributed.checkpoint)
  extra_rank{r}.pt      LR-schedule state and the caller's `extra` (rng, step) of rank r
  hf_config/            the model's HF config, so `export_hf` works from the shards alone
  meta.json             world size, model kind, whether optimizer state is present, LoRA settings, optimizer form
  MANIFEST.json         every file's size and SHA-256, as the rank that wrote it computed them
  COMPLETE              written last, by rank 0, before the directory takes its name

Optimizer state is saved nested (torch's form: moments per parameter name, settings per param group) without
pipeline parallel, and flat (every setting keyed by its parameter's name too) at pipeline_model_parallel_size > 1,
where the stages hold disjoint parameters. `load_checkpoint` takes either form at any dp / tp / sp / pp layout
(DCP reshards the tensors): a pipeline stage loading a nested checkpoint reads the moments under the keys the two
forms share, its parameters' settings from the param groups, and a tied LM head's moments from the embedding's
(one process saves the one tied parameter under the embedding's name).

With LoRA adapters (`Engine.has_adapters`) the shards hold the adapters and their
optimizer state only, never the frozen base weights: the base model comes back from its
own directory (`base_model` of the exports).

All ranks write into `<dir>.tmp-<token>`; rank 0 gathers every rank's file entries, checks that each rank's
files are there (hybridflow/engine/checkpoint_files.py), writes MANIFEST.json, then COMPLETE, and renames it to
`<dir>`. A save that dies midway leaves only the tmp directory, which `latest_checkpoint` skips and
`load_checkpoint` refuses. All ranks must see the same filesystem (true on one machine; use a shared
filesystem across nodes): a rank whose files rank 0 cannot see fails the save.

Loading runs no pickle from the checkpoint: its files are first checked against the manifest, DCP's index and
items are read through `SafeReader` / `SafePlanner`, and the extra state with `torch.load(weights_only=True)`.
A missing, truncated, changed or unexpected file is refused with one `CheckpointError` line naming it.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

import hybridflow.engine.checkpoint_files as F
from hybridflow.engine.base import Engine
from hybridflow.engine.config import LoraConfig
from hybridflow.engine.gather import TIED_HEAD
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.models.value import ValueModel
from hybridflow.utils.atomic import OLD_INFIX, TMP_INFIX, atomic_dir, fresh_dir, temp_sibling
from hybridflow.utils.checkpoint_dirs import COMPLETE_MARKER as COMPLETE
from hybridflow.utils.checkpoint_dirs import commit_checkpoint

if TYPE_CHECKING:
    from hybridflow.engine.base import Engine


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or incompatible (a user error: the CLI prints one line)."""


def _broadcast_token() -> str:
    token = [uuid.uuid4().hex[:8] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return token[0]


# Pipeline stages hold disjoint parameters: the optimizer's param_groups, one object per rank in the nested layout,
# would keep only one stage's; flattened, every setting is keyed by its parameter's name, like the tensors.
_FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def _states(engine: Engine, flat_optim: bool = False) -> dict[str, Any]:
    if engine.has_adapters:
        return _adapter_states(engine)
    if engine.optimizer is None:
        return {"model": engine.module.state_dict()}
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer, options=_FLAT_OPTIM if flat_optim else None)
    return {"model": model_sd, "optim": optim_sd}


# Adapters only: the frozen base is in the model directory already, and saving it would cost its full size per save.
_ADAPTERS_ONLY = StateDictOptions(ignore_frozen_params=True)


def _adapter_states(engine: Engine) -> dict[str, Any]:
    if engine.optimizer is None:
        states = {"model": get_model_state_dict(engine.module, options=_ADAPTERS_ONLY)}
    else:
        model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer, options=_ADAPTERS_ONLY)
        states = {"model": model_sd, "optim": optim_sd}
    # ignore_frozen_params drops a frozen tied weight under one of its names only (lm_head stays): filter by name.
    trainable = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    states["model"] = {k: v for k, v in states["model"].items() if k in trainable}
    return states


def _lora_meta(engine: Engine) -> dict[str, Any] | None:
    """The engine's LoRA settings as meta.json holds them (None: no adapters)."""
    return json.loads(json.dumps(asdict(engine.lora))) if engine.has_adapters else None


def save_checkpoint(engine: Engine, path: Path, extra: dict[str, Any] | None = None) -> Path:
    """Write engine state + per-rank `extra` to `path` atomically (collective: all ranks call it)."""
    rank = engine.rank
    token = _broadcast_token()
    tmp = temp_sibling(path, token)
    if rank == 0:
        fresh_dir(tmp)
    dist.barrier()
    flat = engine.pipeline_stages > 1
    dcp.save(_states(engine, flat), checkpoint_id=tmp)
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler else None
    torch.save({"lr_scheduler": sched, "extra": extra or {}}, tmp / f"extra_rank{rank}.pt")
    reports = F.gather_entries(tmp, rank, engine.world_size)
    if rank == 0:
        engine.hf_config().save_pretrained(tmp / "hf_config")
        meta = {
            "world_size": engine.world_size,
            "value_model": engine.is_value_model,
            "has_optimizer": engine.optimizer is not None,
            "lora": _lora_meta(engine),
            "flat_optim": flat,
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
    problem = _agree(F.missing_rank_file(tmp, reports) if rank == 0 else None)
    if problem is not None:
        raise CheckpointError(f"{tmp} was not sealed: {problem}")
    if rank == 0:
        F.write_engine_manifest(tmp, reports)
        commit_checkpoint(tmp, path)  # fsync, COMPLETE marker, rename into place
    dist.barrier()
    return path


def _agree(problem: str | None) -> str | None:
    """Rank 0's verdict, on every rank (so that all raise together rather than some waiting at a barrier)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def _check_complete(path: Path, verify: bool = True) -> dict[str, Any]:
    """meta.json of the sealed checkpoint `path`, after checking its files against the manifest (`verify`)."""
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker; an interrupted save?); "
            "pick one with latest_checkpoint(root)"
        )
    problem = F.damage(path) if verify else None
    if problem is not None:
        raise CheckpointError(
            f"{path} is damaged: {problem}; it was changed or cut short after it was saved: use an earlier checkpoint"
        )
    if verify:  # DCP would wrap this error in its own multi-line one: read the index here first
        _read(lambda: F.SafeReader(path).read_metadata(), path)
    return json.loads((path / "meta.json").read_text())


def _read(fn: Any, path: Path) -> Any:
    """`fn()`, with a checkpoint file that is not plain data, or shards DCP cannot read (a file cut short under a
    rewritten manifest), reported as one CheckpointError line."""
    try:
        return fn()
    except F.UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    except CheckpointException as err:  # a BaseException, its text a traceback per rank: keep the first cause
        cause = next((exc for exc, _ in err.failures.values()), None)
        if isinstance(cause, F.UnsafeCheckpointError):
            raise CheckpointError(str(cause)) from None
        detail = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'no detail'}"
        raise CheckpointError(f"{path}: its shards could not be read ({detail}); use an earlier checkpoint") from None


def load_checkpoint(engine: Engine, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and LR schedule from `path`; return this rank's `extra` (collective: rank 0
    checks the files against the manifest and every rank learns its verdict)."""
    problem = None
    if engine.rank == 0:
        try:
            _check_complete(path)
        except CheckpointError as err:
            problem = str(err)
    problem = _agree(problem)
    if problem is not None:
        raise CheckpointError(problem)
    meta = _check_complete(path, verify=False)
    if meta["value_model"] != engine.is_value_model:
        raise CheckpointError(f"{path} holds a value_model={meta['value_model']} checkpoint; engine differs")
    if engine.optimizer is not None and not meta["has_optimizer"]:
        raise CheckpointError(f"{path} has no optimizer state; load it into an engine built with optim=None")
    if meta.get("lora") != _lora_meta(engine):
        raise CheckpointError(
            f"{path} holds LoRA settings {meta.get('lora')} (None: full weights), the engine "
            f"has {_lora_meta(engine)}; build it with the checkpoint's lora settings"
        )
    flat = meta.get("flat_optim", False) or engine.pipeline_stages > 1  # the form the engine loads in
    state = _read(lambda: _read_states(engine, path, nested=not meta.get("flat_optim", False)), path)
    # The frozen base weights are absent from an adapter checkpoint on purpose, hence not strict there.
    options = StateDictOptions(ignore_frozen_params=True, strict=False) if engine.has_adapters else None
    options = _FLAT_OPTIM if flat else options
    if engine.optimizer is None:
        set_state_dict(engine.module, [], model_state_dict=state["model"], optim_state_dict={}, options=options)
    else:
        set_state_dict(
            engine.module,
            engine.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
    # A rank the checkpoint did not have (a load on more ranks) takes rank 0's: the LR schedule and the callers'
    # counters are the same on every rank. A rank it had must find its own file (the manifest lists it).
    source = engine.rank if engine.rank < meta["world_size"] else 0
    blob = _read(lambda: F.load_extra(path, source), path)
    if engine.lr_scheduler is not None and blob["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(blob["lr_scheduler"])
    return blob["extra"]


def _read_states(engine: Engine, path: Path, nested: bool) -> dict[str, Any]:
    """The engine's states, read from `path`: in the checkpoint's optimizer form, or flat on a pipeline stage."""
    if not (nested and engine.pipeline_stages > 1 and engine.optimizer is not None):
        state = _states(engine, flat_optim=not nested)
        dcp.load(state, storage_reader=F.SafeReader(path), planner=F.SafePlanner())  # refuses missing keys
        return state
    return _stage_states_from_nested(engine, path)


def _stage_states_from_nested(engine: Engine, path: Path) -> dict[str, Any]:
    """A pipeline stage's flat states from a checkpoint saved without pp: the moments and step counts share their
    keys with the flat form; the settings come from the checkpoint's param groups (one object per group, with its
    parameters' names); a tied LM head's moments from the embedding's, the one name one process saves them under."""
    state = _states(engine, flat_optim=True)
    saved = F.SafeReader(path).read_metadata().state_dict_metadata
    moments = {_saved_name(k, saved): v for k, v in state["optim"].items() if k.startswith("state.")}
    groups = {k.removeprefix("optim."): None for k in saved if k.startswith("optim.param_groups.")}
    read = {"model": state["model"], "optim": {**moments, **groups}}
    dcp.load(read, storage_reader=F.SafeReader(path), planner=F.SafePlanner())  # each group's None replaced
    settings = _settings_by_param({k: read["optim"][k] for k in groups})
    for key in [k for k in state["optim"] if k.startswith("param_groups.")]:
        fqn, setting = key.removeprefix("param_groups.").rsplit(".", 1)
        own = settings.get(fqn) or settings.get(TIED_HEAD.get(fqn, ""))
        if own is None or setting not in own:
            raise CheckpointError(f"{path} has no optimizer setting {setting!r} for {fqn}")
        state["optim"][key] = own[setting]
    return state


def _saved_name(key: str, saved: Mapping[str, Any]) -> str:
    """`key` ("state.<param>.<moment>") as the checkpoint holds it: a tied head's under the embedding's name."""
    for alias, src in TIED_HEAD.items():
        if f"optim.{key}" not in saved and key.startswith(f"state.{alias}."):
            return f"state.{src}." + key.removeprefix(f"state.{alias}.")
    return key


def _settings_by_param(groups: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{"param_groups.<i>.<setting>": value} of a nested optimizer state -> {param name: {setting: value}}."""
    by_group: dict[str, dict[str, Any]] = {}
    for key, value in groups.items():
        _, index, setting = key.split(".", 2)
        by_group.setdefault(index, {})[setting] = value
    return {fqn: group for group in by_group.values() for fqn in group.get("params", ())}


def _step_of(path: Path) -> int:
    match = re.search(r"(\d+)$", path.name)
    return int(match.group(1)) if match else -1


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """Newest COMPLETE checkpoint directly under `root` (by trailing step number, then mtime)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [
        p
        for p in root.iterdir()
        if p.is_dir() and (p / COMPLETE).is_file() and TMP_INFIX not in p.name and OLD_INFIX not in p.name
    ]
    return max(done, key=lambda p: (_step_of(p), p.stat().st_mtime), default=None)


def _empty_hf_model(config: Any, value_model: bool) -> torch.nn.Module:
    if value_model:
        return AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _model_from_checkpoint(path: Path, base_model: str | os.PathLike | None) -> torch.nn.Module:
    meta = _check_complete(path)
    if meta.get("lora"):
        return _adapted_model(path, meta, base_model).merge_and_unload()
    config = AutoConfig.from_pretrained(path / "hf_config")
    model = _empty_hf_model(config, meta["value_model"])
    holder = ValueModel(model) if meta["value_model"] else model  # same names as when saved
    _read(
        lambda: dcp.load(
            {"model": holder.state_dict()}, storage_reader=F.SafeReader(path), planner=F.SafePlanner(), no_dist=True
        ),
        path,
    )
    return model


def _adapted_model(path: Path, meta: dict[str, Any], base_model: str | os.PathLike | None) -> Any:
    """The base model at `base_model` with the adapters of the LoRA checkpoint at `path` (a peft model)."""
    from hybridflow.engine.lora import apply_lora  # noqa: PLC0415  (lazy: peft, only LoRA runs need it)

    if base_model is None:
        raise CheckpointError(
            f"{path} holds LoRA adapters, not full weights: pass the base model they were "
            "trained on (hybridflow export reads it from the run's trainer_state.json, or "
            "takes --base-model)"
        )
    model = apply_lora(load_causal_lm(base_model), LoraConfig(**meta["lora"]))
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    _read(
        lambda: dcp.load({"model": adapters}, storage_reader=F.SafeReader(path), planner=F.SafePlanner(), no_dist=True),
        path,
    )  # in place
    return model


def export_adapter(ckpt: str | os.PathLike, out_dir: str | os.PathLike, base_model: str | os.PathLike | None) -> Path:
    """Write the adapters of a LoRA checkpoint as a peft adapter directory (adapter_config.json +
    adapter_model.safetensors), loadable with `peft.PeftModel.from_pretrained(base, out_dir)`."""
    path, out = Path(ckpt), Path(out_dir)
    meta = _check_complete(path)
    if not meta.get("lora"):
        raise CheckpointError(f"{path} holds full weights, no LoRA adapters; export it without --adapter")
    model = _adapted_model(path, meta, base_model)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
    return out


def export_hf(
    source: Engine | str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    base_model: str | os.PathLike | None = None,
) -> Path:
    """Write a full HF directory (safetensors + config + tokenizer) from an engine or a checkpoint.

    From an engine this is collective (all ranks call it; rank 0 writes). `tokenizer` is a
    tokenizer object or a model path to take it from; None writes weights and config only.
    A LoRA checkpoint needs `base_model`, the directory of the model its adapters were trained
    on; the adapters are merged into it (an engine with adapters exports merged weights too).
    """

    out = Path(out_dir)
    if isinstance(source, Engine):
        state = source.full_state_dict()
        if source.rank != 0:
            dist.barrier()
            return out
        model = _empty_hf_model(source.hf_config(), source.is_value_model)
        model.load_state_dict(state, strict=True)
    else:
        model = _model_from_checkpoint(Path(source), base_model)
    _write_hf(model, out, tokenizer)
    if isinstance(source, Engine):
        dist.barrier()
    return out


def _write_hf(model: torch.nn.Module, out: Path, tokenizer: Any) -> None:
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
