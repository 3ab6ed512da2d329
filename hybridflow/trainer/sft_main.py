"""Entry point of an SFT run: config -> inputs -> resolved run -> workers -> SFTTrainer.fit -> report.

`hybridflow sft [--config FILE] [--print-config] key=value ...` (or `python -m
hybridflow.trainer.sft_main ...`). `--print-config` prints the resolved run as YAML and
exits before any worker starts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from hybridflow.config_utils import load_config
from hybridflow.trainer.main import fit_with_restarts, run_command
from hybridflow.trainer.sft_config import ResolvedSFT, SFTConfig, resolve_sft


class SFTInputs(NamedTuple):
    """What the controller reads before any worker starts."""

    tokenizer: Any
    train_loader: Any
    val_loader: Any
    resume_from: Path | None = None
    """The checkpoint to continue from (trainer.resume_mode), checked before any worker starts."""


def prepare_inputs(cfg: SFTConfig) -> SFTInputs:
    """Tokenizer and train/val loaders; a bad model path, file, column or length fails here."""
    from functools import partial

    from hybridflow.data.loader import StatefulDataLoader
    from hybridflow.data.sft import SFTDataset, sft_collate
    from hybridflow.models import load_tokenizer, resolve_model_path
    from hybridflow.trainer.data_setup import task_files

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
    train_loader = StatefulDataLoader(train, d.train_batch_size, seed=d.seed, shuffle=d.shuffle, collate_fn=collate)
    # A few micro-batches per worker per call: fewer dispatch round trips, bounded memory.
    val_bs = min(d.micro_batch_size_per_device * cfg.world_size * 4, len(val))
    val_loader = StatefulDataLoader(val, val_bs, shuffle=False, collate_fn=collate, drop_last=False)
    return SFTInputs(tokenizer, train_loader, val_loader)


def load_run(config_path: str | None, overrides: Sequence[str]) -> tuple[ResolvedSFT, SFTInputs]:
    """Load, check and resolve an SFT run and read its inputs; starts no worker."""
    from hybridflow.trainer.checkpointing import resume_path

    cfg = load_config(SFTConfig, config_path, overrides)
    inputs = prepare_inputs(cfg)
    resolved = resolve_sft(cfg, len(inputs.train_loader))
    return resolved, inputs._replace(resume_from=resume_path(resolved.config))


def _build_workers(run: ResolvedSFT) -> tuple[Any, Callable[[], None]]:
    """(one SFTWorker per rank on Ray or in-process (trainer.backend), release() of their placement)."""
    from hybridflow.controller.resource_pool import ClassWithInitArgs
    from hybridflow.trainer.roles import group_factory
    from hybridflow.workers.sft import SFTWorker

    cfg, t = run.config, run.config.trainer
    cls = ClassWithInitArgs(
        SFTWorker, cfg.model, cfg.engine, cfg.optim, cfg.data.micro_batch_size_per_device, cfg.lora, plugins=t.plugins
    )
    make_group, pools, release = group_factory(t, [run.config.world_size], "sft")
    return make_group(pools[0], cls), release


def run(resolved: ResolvedSFT, inputs: SFTInputs) -> list[float]:
    """Train as resolved, recovering from worker failures; returns the validation losses computed, in order."""
    from hybridflow.trainer.sft_trainer import SFTTrainer

    def carry(old: SFTTrainer, new: SFTTrainer) -> None:
        new.val_history = old.val_history

    _, losses = fit_with_restarts(
        resolved.config,
        inputs,
        lambda: _build_workers(resolved),
        lambda built: [built[0]],
        "loading model",
        lambda built: built[1](),
        lambda built, run_inputs, tracker, recovery: SFTTrainer(resolved, built[0], run_inputs, tracker, recovery),
        carry,
    )
    _report(Path(resolved.config.trainer.log_dir), losses)
    return losses


def _report(log_dir: Path, val_losses: list[float]) -> None:
    from hybridflow.utils.plot import plot_run, summarize_run

    if val_losses:
        print(f"val/loss: first {val_losses[0]:.4f} -> last {val_losses[-1]:.4f}")
    metrics_file = log_dir / "metrics.jsonl"
    if metrics_file.exists():
        print(summarize_run(metrics_file))
        print(f"plot: {plot_run(metrics_file, log_dir / 'run.png')}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry of `hybridflow sft`; user errors print one line and exit 2."""
    return run_command(
        sys.argv[1:] if argv is None else argv, "hybridflow sft", "Supervised fine-tuning (see README).", load_run, run
    )


if __name__ == "__main__":
    sys.exit(main())
