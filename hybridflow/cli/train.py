"""Entry point of a training run: config -> inputs -> measure -> resolve -> workers -> PPOTrainer.fit -> report.

`python -m hybridflow.cli.train [--config FILE] [--print-config] key=value ...` is the
same as `hybridflow train ...`. `--print-config` prints the resolved run (every derived
value filled in) as YAML and exits before any worker starts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridflow.cli.args import TRAIN_DESCRIPTION, TRAIN_PROG, parse_args
from hybridflow.cli.command import run_command
from hybridflow.config.measure import measure
from hybridflow.config.resolve import ResolvedRun, resolve
from hybridflow.config.run import RunConfig
from hybridflow.controller.ray.start import RayStartTimeout
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.parity import ParityError
from hybridflow.planner.profile import write_profile
from hybridflow.rewards import RewardManager, load_custom_reward_fn
from hybridflow.rewards.manager import NonFiniteRewardError
from hybridflow.train.checkpointing import resume_path
from hybridflow.train.data_setup import check_data_sources, make_loaders
from hybridflow.train.job import fit_with_restarts
from hybridflow.train.ppo_trainer import PPOTrainer
from hybridflow.train.recovery import RunFailedError
from hybridflow.train.roles import build_roles
from hybridflow.train.skip_guard import SkippedUpdatesError
from hybridflow.utils.config_loader import load_config
from hybridflow.workers.teacher import check_teacher_tokenizer

if TYPE_CHECKING:  # heavy imports, loaded where the workers start
    from hybridflow.train.ppo_trainer import PPOTrainer
    from hybridflow.train.recovery import Recovery
    from hybridflow.utils.tracking import Tracking

log = logging.getLogger("hybridflow")


def make_reward_fn(cfg: RunConfig, tokenizer: Any):
    """The reward manager: rule scorers by data_source, or the configured custom function."""

    custom = cfg.reward.custom_reward_function
    fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    return RewardManager(tokenizer, fn, num_workers=cfg.reward.num_workers, non_finite=cfg.reward.non_finite)


class RunInputs(NamedTuple):
    """What the controller reads before any worker starts."""

    tokenizer: Any
    train_loader: Any
    val_loader: Any
    reward_fn: Any
    resume_from: Path | None = None
    """The checkpoint to continue from (trainer.resume_mode), checked before any worker starts."""


def prepare_inputs(cfg: RunConfig) -> RunInputs:
    """Tokenizer, train/val loaders and reward function; every input problem surfaces here.

    Runs before any worker starts, so a bad model path, parquet file or batch size fails
    fast with one message and nothing is written to the checkpoint directory.
    """

    path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or path)
    if cfg.distillation.enabled:  # the teacher scores the student's token ids: refused here if it reads others
        check_teacher_tokenizer(cfg.distillation.teacher.path, tokenizer, cfg.model.tokenizer_path or cfg.model.path)
    train_loader, val_loader = make_loaders(cfg.data, tokenizer)
    turns = cfg.rollout.multi_turn
    if not cfg.reward.custom_reward_function.path and (not turns.enable or turns.env == "tool"):
        check_data_sources(train_loader.dataset, val_loader.dataset)
    if cfg.judge.enable:
        check_judge_prompts(cfg)
    return RunInputs(tokenizer, train_loader, val_loader, make_reward_fn(cfg, tokenizer))


def check_judge_prompts(cfg: RunConfig) -> None:
    """Refuse a judge whose prompts can outgrow judge.rollout.prompt_length or its model's context (one line)."""
    from hybridflow.workers.judge import judge_context  # noqa: PLC0415  (lazy: torch and the rollout)

    judge_path = resolve_model_path(cfg.judge.model.path)
    judge_tokenizer = load_tokenizer(cfg.judge.model.tokenizer_path or judge_path)
    judge_context(cfg.judge, judge_tokenizer, cfg.data.max_prompt_length, cfg.data.max_response_length)


def load_run(config_path: str | None, overrides: Sequence[str]) -> tuple[ResolvedRun, RunInputs]:
    """Load and check the config, read the inputs, measure this machine, resolve; starts no worker.
    What resolve chose for the user (the planner's layouts) is logged, never printed on stdout."""

    cfg = load_config(RunConfig, config_path, overrides)
    inputs = prepare_inputs(cfg)
    resolved = resolve(cfg, len(inputs.train_loader), measure(cfg))
    for note in resolved.notes:
        log.info("%s", note)
    return resolved, inputs._replace(resume_from=resume_path(resolved.config))


class PPOJob:
    """A PPO run's worker groups (train/roles.py) and PPOTrainer, as `fit_with_restarts` drives them."""

    label = "loading models"

    def __init__(self, run: ResolvedRun) -> None:
        self.run, self.config = run, run.config
        self.roles: Any = None
        self.trainer: PPOTrainer | None = None

    def build_workers(self) -> list:
        """One worker group per worker set (train/roles.py); models not loaded."""

        self.roles = build_roles(self.run)
        return self.roles.all()

    def release(self) -> None:
        """Free the roles' placement groups."""
        self.roles.release()

    def make_trainer(self, inputs: RunInputs, tracker: Tracking, recovery: Recovery) -> PPOTrainer:
        """A PPOTrainer over the roles built last, with the previous trainer's validation results."""

        fresh = PPOTrainer(self.run, self.roles, inputs, tracker, recovery)
        if self.trainer is not None:
            fresh.first_val, fresh.last_val = self.trainer.first_val, self.trainer.last_val
        self.trainer = fresh
        return fresh


def run(resolved: ResolvedRun, inputs: RunInputs) -> dict[str, dict[str, float]]:
    """Train as resolved, recovering from worker failures; returns {"before": val metrics, "after": val metrics}."""
    trainer, after = fit_with_restarts(PPOJob(resolved), inputs)
    _report(Path(resolved.config.trainer.log_dir), trainer.first_val, after)
    return {"before": trainer.first_val, "after": after}


def _report(log_dir: Path, before: dict[str, float], after: dict[str, float]) -> None:
    from hybridflow.utils.plot import plot_run, summarize_run  # noqa: PLC0415  (lazy: matplotlib, only for the end-of-run plots)

    for key in sorted(set(before) | set(after)):
        print(f"{key}: before {before.get(key, float('nan')):.3f} -> after {after.get(key, float('nan')):.3f}")
    metrics_file = log_dir / "metrics.jsonl"
    if metrics_file.exists():
        print(summarize_run(metrics_file))
        print(f"plot: {plot_run(metrics_file, log_dir / 'run.png')}")
        profile = write_profile(log_dir)
        if profile is not None:
            print(f"profile: {profile}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry of `python -m hybridflow.cli.train`: parse the arguments, then `train` (`hybridflow train`
    parses them in cli/main.py, so that its --help needs no torch)."""
    return train(parse_args(argv, TRAIN_PROG, TRAIN_DESCRIPTION))


def train(args: argparse.Namespace) -> int:
    """`hybridflow train` on parsed arguments: --list-keys prints the config keys; else load, measure, resolve,
    then print the run (--print-config: YAML only on stdout) or train it. Bad config, paths or data exit 2 with one
    line; a failure the run cannot recover from, a parity check that failed (trainer.parity=error), a non-finite
    reward (reward.non_finite=error), trainer.max_skipped_updates skipped updates in a row or a Ray that did not
    start within trainer.ray_start_timeout_s exit 1
    with one line (--debug: each after its traceback)."""
    errors = (RunFailedError, ParityError, NonFiniteRewardError, SkippedUpdatesError, RayStartTimeout)
    return run_command(TRAIN_PROG, "train", args, load_run, run, errors)


if __name__ == "__main__":
    sys.exit(main())
