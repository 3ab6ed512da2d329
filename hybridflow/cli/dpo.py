"""Entry point of a DPO run: config -> inputs -> measure -> resolve -> workers -> DPOTrainer.fit -> report.

`hybridflow dpo [--config FILE] [--print-config] key=value ...` (or `python -m hybridflow.cli.dpo ...`),
built as `hybridflow sft` is (cli/sft.py). `--print-config` prints the resolved run as YAML and exits
before any worker starts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.cli.args import DPO_DESCRIPTION, DPO_PROG, parse_args
from hybridflow.cli.command import run_command
from hybridflow.cli.sft import SFTInputs, SFTJob, loaders
from hybridflow.config.dpo import DPOConfig, resolve_dpo
from hybridflow.config.measure import measure_dtypes
from hybridflow.config.sft import ResolvedJob
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.data.preference import PreferenceDataset, preference_collate
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.train.checkpointing import resume_path
from hybridflow.train.data_setup import task_files
from hybridflow.train.dpo_trainer import DPOTrainer
from hybridflow.train.job import fit_with_restarts
from hybridflow.train.recovery import RunFailedError
from hybridflow.train.roles import group_factory
from hybridflow.utils.config_loader import load_config
from hybridflow.workers.dpo import DPOWorker

if TYPE_CHECKING:
    from hybridflow.train.recovery import Recovery
    from hybridflow.utils.tracking import Tracking


def prepare_inputs(cfg: DPOConfig) -> SFTInputs:
    """Tokenizer and train/val loaders of pairs; a bad model path, file, column, pair or length fails here."""
    d = cfg.data
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or resolve_model_path(cfg.model.path))
    kw = dict(
        max_length=d.max_length,
        truncation=d.truncation,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        invalid_pairs=d.invalid_pairs,
    )
    train_files, val_files = task_files(d, preference=True)
    train, val = PreferenceDataset(train_files, tokenizer, **kw), PreferenceDataset(val_files, tokenizer, **kw)
    collate = partial(preference_collate, pad_token_id=train.pad_token_id)
    return SFTInputs(tokenizer, *loaders(train, val, collate, d, cfg.world_size))


def load_run(config_path: str | None, overrides: Sequence[str]) -> tuple[ResolvedJob, SFTInputs]:
    """Load and check the config, read the inputs, measure this machine, resolve; starts no worker."""
    cfg = load_config(DPOConfig, config_path, overrides)
    inputs = prepare_inputs(cfg)
    resolved = resolve_dpo(cfg, len(inputs.train_loader), measure_dtypes(cfg.trainer, [cfg.engine.param_dtype]))
    return resolved, inputs._replace(resume_from=resume_path(resolved.config))


class DPOJob(SFTJob):
    """A DPO run's worker group (one DPOWorker per rank) and DPOTrainer, as `fit_with_restarts` drives them."""

    def build_workers(self) -> list:
        """One DPOWorker per rank on Ray or in-process (trainer.backend); models not loaded."""
        cfg = self.config
        cls = ClassWithInitArgs(
            DPOWorker,
            cfg.model,
            cfg.engine,
            cfg.optim,
            cfg.data.micro_batch_size_per_device,
            cfg.dpo,
            cfg.lora,
            plugins=cfg.trainer.plugins,
        )
        make_group, pools, self._release = group_factory(cfg.trainer, [cfg.world_size], "dpo")
        self.group = make_group(pools[0], cls)
        return [self.group]

    def make_trainer(self, inputs: Any, tracker: Tracking, recovery: Recovery) -> DPOTrainer:
        """A DPOTrainer over the group built last, with the previous trainer's validation losses."""
        fresh = DPOTrainer(self.run, self.group, inputs, tracker, recovery)
        if self.trainer is not None:
            fresh.val_history = self.trainer.val_history
        self.trainer = fresh
        return fresh


def run(resolved: ResolvedJob, inputs: SFTInputs) -> list[float]:
    """Train as resolved, recovering from worker failures; returns the validation losses computed, in order."""
    _, losses = fit_with_restarts(DPOJob(resolved), inputs)
    _report(Path(resolved.config.trainer.log_dir))
    return losses


def _report(log_dir: Path) -> None:
    from hybridflow.utils.plot import plot_run, summarize_run  # noqa: PLC0415  (lazy: matplotlib, only for the end-of-run plots)

    metrics_file = log_dir / "metrics.jsonl"
    if metrics_file.exists():
        print(summarize_run(metrics_file))
        print(f"plot: {plot_run(metrics_file, log_dir / 'run.png')}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry of `python -m hybridflow.cli.dpo`: parse the arguments, then `dpo`."""
    return dpo(parse_args(argv, DPO_PROG, DPO_DESCRIPTION))


def dpo(args: argparse.Namespace) -> int:
    """`hybridflow dpo` on parsed arguments, as `hybridflow sft`: --list-keys prints the config keys, user errors
    exit 2 with one line, a failure the run cannot recover from exits 1."""
    return run_command(DPO_PROG, "dpo", args, load_run, run, (RunFailedError,))


if __name__ == "__main__":
    sys.exit(main())
