"""Entry point of an SFT run: config -> inputs -> measure -> resolve -> workers -> SFTTrainer.fit -> report.

`hybridflow sft [--config FILE] [--print-config] key=value ...` (or `python -m
hybridflow.cli.sft ...`). `--print-config` prints the resolved run as YAML and
exits before any worker starts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridflow.cli.args import SFT_DESCRIPTION, SFT_PROG, parse_args
from hybridflow.cli.command import run_command
from hybridflow.config.measure import measure_dtypes
from hybridflow.config.sft import ResolvedJob, SFTConfig, resolve_sft
from hybridflow.controller.ray.start import RayStartTimeout
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.data.loader import StatefulDataLoader
from hybridflow.data.sft import SFTDataset, sft_collate
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.train.checkpointing import resume_path
from hybridflow.train.data_setup import task_files
from hybridflow.train.job import fit_with_restarts
from hybridflow.train.recovery import RunFailedError
from hybridflow.train.roles import group_factory
from hybridflow.train.sft_trainer import SFTTrainer
from hybridflow.train.skip_guard import SkippedUpdatesError
from hybridflow.utils.config_loader import load_config
from hybridflow.workers.sft import SFTWorker

if TYPE_CHECKING:  # heavy imports, loaded where the workers start
    from hybridflow.train.recovery import Recovery
    from hybridflow.train.sft_trainer import SFTTrainer
    from hybridflow.utils.tracking import Tracking


class SFTInputs(NamedTuple):
    """What the controller reads before any worker starts."""

    tokenizer: Any
    train_loader: Any
    val_loader: Any
    resume_from: Path | None = None
    """The checkpoint to continue from (trainer.resume_mode), checked before any worker starts."""


def prepare_inputs(cfg: SFTConfig) -> SFTInputs:
    """Tokenizer and train/val loaders; a bad model path, file, column or length fails here."""

    d = cfg.data
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or resolve_model_path(cfg.model.path))
    kw = dict(
        max_length=d.max_length,
        truncation=d.truncation,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        messages_key=d.messages_key,
    )
    train_files, val_files = task_files(d, sft=True)
    train, val = SFTDataset(train_files, tokenizer, **kw), SFTDataset(val_files, tokenizer, **kw)
    collate = partial(sft_collate, pad_token_id=train.pad_token_id)
    return SFTInputs(tokenizer, *loaders(train, val, collate, d, cfg.world_size))


def loaders(
    train: Any, val: Any, collate: Any, d: Any, world_size: int
) -> tuple[StatefulDataLoader, StatefulDataLoader]:
    """The train loader (seeded, resumable) and the val loader of an SFT or DPO run's datasets (`d`: its data section)."""
    train_loader = StatefulDataLoader(train, d.train_batch_size, seed=d.seed, shuffle=d.shuffle, collate_fn=collate)
    # A few micro-batches per worker per call: fewer dispatch round trips, bounded memory.
    val_bs = min(d.micro_batch_size_per_device * world_size * 4, len(val))
    val_loader = StatefulDataLoader(val, val_bs, shuffle=False, collate_fn=collate, drop_last=False)
    return train_loader, val_loader


def load_run(config_path: str | None, overrides: Sequence[str]) -> tuple[ResolvedJob, SFTInputs]:
    """Load and check the config, read the inputs, measure this machine, resolve; starts no worker."""

    cfg = load_config(SFTConfig, config_path, overrides)
    inputs = prepare_inputs(cfg)
    resolved = resolve_sft(cfg, len(inputs.train_loader), measure_dtypes(cfg.trainer, [cfg.engine.param_dtype]))
    return resolved, inputs._replace(resume_from=resume_path(resolved.config))


class SFTJob:
    """An SFT run's worker group (one SFTWorker per rank) and SFTTrainer, as `fit_with_restarts` drives them."""

    label = "loading model"

    def __init__(self, run: ResolvedJob) -> None:
        self.run, self.config = run, run.config
        self.group: Any = None
        self.trainer: SFTTrainer | None = None
        self._release: Callable[[], None] = lambda: None

    def build_workers(self) -> list:
        """One SFTWorker per rank on Ray or in-process (trainer.backend); models not loaded."""

        cfg = self.config
        cls = ClassWithInitArgs(
            SFTWorker,
            cfg.model,
            cfg.engine,
            cfg.optim,
            cfg.data.micro_batch_size_per_device,
            cfg.lora,
            plugins=cfg.trainer.plugins,
        )
        make_group, pools, self._release = group_factory(cfg.trainer, [cfg.world_size], "sft")
        self.group = make_group(pools[0], cls)
        return [self.group]

    def release(self) -> None:
        """Free the group's placement."""
        self._release()

    def make_trainer(self, inputs: SFTInputs, tracker: Tracking, recovery: Recovery) -> SFTTrainer:
        """An SFTTrainer over the group built last, with the previous trainer's validation losses."""

        fresh = SFTTrainer(self.run, self.group, inputs, tracker, recovery)
        if self.trainer is not None:
            fresh.val_history = self.trainer.val_history
        self.trainer = fresh
        return fresh


def run(resolved: ResolvedJob, inputs: SFTInputs) -> list[float]:
    """Train as resolved, recovering from worker failures; returns the validation losses computed, in order."""
    _, losses = fit_with_restarts(SFTJob(resolved), inputs)
    _report(Path(resolved.config.trainer.log_dir), losses)
    return losses


def _report(log_dir: Path, val_losses: list[float]) -> None:
    from hybridflow.utils.plot import plot_run, summarize_run  # noqa: PLC0415  (lazy: matplotlib, only for the end-of-run plots)

    if val_losses:
        print(f"val/loss: first {val_losses[0]:.4f} -> last {val_losses[-1]:.4f}")
    metrics_file = log_dir / "metrics.jsonl"
    if metrics_file.exists():
        print(summarize_run(metrics_file))
        print(f"plot: {plot_run(metrics_file, log_dir / 'run.png')}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry of `python -m hybridflow.cli.sft`: parse the arguments, then `sft` (`hybridflow sft`
    parses them in cli/main.py, so that its --help needs no torch)."""
    return sft(parse_args(argv, SFT_PROG, SFT_DESCRIPTION))


def sft(args: argparse.Namespace) -> int:
    """`hybridflow sft` on parsed arguments, as `hybridflow train`'s (cli/train.py train): --list-keys prints the
    config keys, user errors exit 2 with one line, a failure the run cannot recover from exits 1."""
    return run_command(SFT_PROG, "sft", args, load_run, run, (RunFailedError, SkippedUpdatesError, RayStartTimeout))


if __name__ == "__main__":
    sys.exit(main())
