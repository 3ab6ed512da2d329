"""Trainer checkpoints: every worker group's shards plus the controller's own state, atomically.

Layout: <trainer.default_local_dir>/global_step_<N>/{actor,critic}/ (sharded engine
checkpoints written by the workers; SFT writes actor/ only), trainer_state.json (step,
dataloader position, the trainer's own state such as PPO's KL coefficient, the model path
for exports, the run's name), rollout_queue/ (trainer.mode one_step_off / async: the batches
generated ahead of step N), config.yaml (the resolved config) and MANIFEST.json (every
file's size and SHA-256). `RunCheckpointer` does this for any trainer; `TrainerCheckpointer`
is PPO's. The directory is built under a temporary name and renamed only when everything
is written and marked COMPLETE, so a crash never leaves a checkpoint that a resume would
pick up; a resume verifies the manifest and falls back to the previous checkpoint when the
newest is damaged.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.models import resolve_model_path
from hybridflow.utils import checkpoint_dirs as C
from hybridflow.utils.config_loader import to_yaml

if TYPE_CHECKING:  # these pull in the worker and engine stack; export and generate read checkpoints without it
    from hybridflow.config.run import RunConfig
    from hybridflow.train.async_pipeline import RolloutSource
    from hybridflow.train.roles import Roles

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
"""The resolved config the checkpoint was written under (loadable with --config)."""


def actor_dir(ckpt: Path) -> Path:
    """The actor's sharded checkpoint inside a trainer checkpoint (or `ckpt` itself)."""
    return ckpt / "actor" if (ckpt / "actor").is_dir() else ckpt


def tokenizer_of(ckpt: Path, explicit: str | None) -> str | None:
    """The tokenizer to ship with an export: `explicit` (--tokenizer), else the model path the run trained."""
    return explicit or model_of(ckpt)


def model_of(ckpt: Path) -> str | None:
    """The model directory the run of trainer checkpoint `ckpt` trained (a LoRA run's base model), or None."""
    state = ckpt / STATE_FILE
    if state.exists():
        return str(resolve_model_path(json.loads(state.read_text()).get("model_path", "default")))
    return None


class RunCheckpointer:
    """Saves and restores worker groups, the dataloader position and the trainer's own state, atomically.

    Every trainer uses it (PPO through `TrainerCheckpointer`, SFT directly); each group's
    `save_checkpoint(dir)` / `load_checkpoint(dir)` writes / reads its own subdirectory.
    """

    def __init__(self, cfg: Any, groups: Sequence[Any], train_loader: Any) -> None:
        """`cfg`: the run config (RunConfig, SFTConfig): trainer.*, model.path."""
        self.cfg, self.groups, self.loader = cfg, list(groups), train_loader
        self.root = Path(cfg.trainer.default_local_dir)

    def save(
        self, step: int, extra: dict[str, Any] | None = None, write: Callable[[Path], dict[str, Any]] | None = None
    ) -> Path:
        """Write global_step_<step> with `extra` in its state file, then prune to trainer.max_ckpt_to_keep.
        `write(dir)`, if given, writes more files into the checkpoint and returns more state entries."""
        final = C.step_dir(self.root, step)
        with C.atomic_dir(final) as tmp:
            for group in self.groups:
                group.save_checkpoint(str(tmp))
            extra = {**(extra or {}), **(write(tmp) if write is not None else {})}
            state = {
                "global_step": step,
                "loader": self.loader.state_dict(),
                **extra,
                "model_path": self.cfg.model.path,
                "run": run_name(self.cfg),
            }
            C.write_json_atomic(tmp / STATE_FILE, state)
            (tmp / CONFIG_FILE).write_text(to_yaml(self.cfg))
        if self.cfg.trainer.max_ckpt_to_keep:
            C.prune_checkpoints(self.root, self.cfg.trainer.max_ckpt_to_keep)
        log.debug("saved checkpoint %s", final)  # the trainer's phase line reports it on the console
        return final

    def resume(self, path: Path | None) -> tuple[int, dict[str, Any]]:
        """Restore the groups and the dataloader from `path` (found by `resume_path` before the workers
        started); return (the step to continue from, the saved state), or (0, {}) when `path` is None.
        First deletes the temporary directories of saves that crashed processes left behind."""
        for stale in C.remove_stale_tmp(self.root):  # this process is the run's only checkpoint writer
            log.info("deleted %s, a checkpoint a crashed run was writing", stale)
        if path is None:
            return 0, {}
        state = json.loads((path / STATE_FILE).read_text())
        for group in self.groups:
            group.load_checkpoint(str(path))
        self.loader.load_state_dict(state["loader"])
        log.info("resumed from %s at step %d", path, state["global_step"])
        return int(state["global_step"]), state


class TrainerCheckpointer:
    """PPO's checkpoints: the actor and critic groups, the KL coefficient, and what the rollout has in flight
    (trainer.mode one_step_off / async: the batches generated ahead, hybridflow/train/async_pipeline.py)."""

    def __init__(self, cfg: RunConfig, roles: Roles, train_loader: Any, rollout: RolloutSource) -> None:
        """`rollout`: the trainer's batch source (SyncRollout / AsyncRollout)."""
        groups = [g for g in (roles.actor_rollout, roles.critic) if g is not None]
        self.checkpointer = RunCheckpointer(cfg, groups, train_loader)
        self.root = self.checkpointer.root
        self.rollout = rollout

    def save(self, step: int, kl_ctrl: Any) -> Path:
        """Write global_step_<step> atomically, then prune to trainer.max_ckpt_to_keep."""
        return self.checkpointer.save(step, {"kl_coef": float(kl_ctrl.value)}, self.rollout.save)

    def resume(self, kl_ctrl: Any, path: Path | None) -> int:
        """Restore workers, dataloader, KL coefficient and the rollout's queue from `path` (None: start the
        rollout fresh); return the step to continue from."""
        step, state = self.checkpointer.resume(path)
        if step:
            kl_ctrl.value = state["kl_coef"]
        self.rollout.start(step, path, state)
        return step


def _report_damaged(path: Path, problem: str) -> None:
    log.warning("checkpoint %s is damaged (%s); resuming from the previous complete one", path, problem)


def check_writable(cfg: Any) -> None:
    """Fail before the first step, not at the first save, when checkpoints cannot be written."""
    t = cfg.trainer
    if t.save_freq <= 0:
        return
    root = Path(t.default_local_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"trainer.default_local_dir={root} cannot be written ({err.strerror or err}); "
            "fix its permissions or point trainer.default_local_dir elsewhere"
        ) from None


def run_name(cfg: Any) -> str:
    """ "<project_name>/<experiment_name>": recorded in every checkpoint of the run."""
    return f"{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"


def resume_path(cfg: Any) -> Path | None:
    """The checkpoint to resume from under trainer.resume_mode, or None to start fresh.

    `cfg`: any run config with a `trainer` section (RunConfig, SFTConfig). Called once before any
    worker starts (a wrong path fails fast) and again by `resume`.
    resume_mode=auto continues this run only: a checkpoint another run wrote into the same
    directory is refused rather than silently continued.
    """
    t = cfg.trainer
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        path = Path(t.resume_from_path)
        if not C.is_complete(path):
            raise FileNotFoundError(
                f"trainer.resume_from_path={path} is not a complete checkpoint "
                f"(no {path}/COMPLETE); pick a global_step_<N> directory that finished saving"
            )
        problem = C.damage(path)
        if problem:
            raise ValueError(f"trainer.resume_from_path={path} is damaged: {problem}; pick an earlier checkpoint")
        return path
    root = Path(t.default_local_dir)
    path = C.find_latest_valid(root, _report_damaged) if root.exists() else None
    theirs = json.loads((path / STATE_FILE).read_text()).get("run") if path is not None else None
    if theirs is not None and theirs != run_name(cfg):  # None: written before runs were named in checkpoints
        raise ValueError(
            f"trainer.default_local_dir={root} holds checkpoints of run {theirs!r}, but this run is "
            f"{run_name(cfg)!r} (trainer.project_name/experiment_name); give this run its own "
            "trainer.default_local_dir, or continue that checkpoint with trainer.resume_mode=resume_path"
        )
    return path
