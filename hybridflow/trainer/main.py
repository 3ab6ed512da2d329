"""Entry point of a training run: config -> inputs -> resolved run -> workers -> PPOTrainer.fit -> report.

`python -m hybridflow.trainer.main [--config FILE] [--print-config] key=value ...` is the
same as `hybridflow train ...`. `--print-config` prints the resolved run (every derived
value filled in) as YAML and exits before any worker starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from hybridflow.config_utils import load_config, to_yaml
from hybridflow.trainer.checkpointing import check_writable
from hybridflow.trainer.recovery import RunFailedError
from hybridflow.trainer.resolve import ResolvedRun, resolve
from hybridflow.trainer.run_config import RunConfig

log = logging.getLogger("hybridflow")
T = TypeVar("T")

USER_ERRORS = (ValueError, KeyError, TypeError, FileNotFoundError, NotADirectoryError)
"""What bad config, paths or data raise; the CLI prints these as one line instead of a traceback."""


def make_reward_fn(cfg: RunConfig, tokenizer: Any):
    """The reward manager: rule scorers by data_source, or the configured custom function."""
    from hybridflow.rewards import RewardManager, load_custom_reward_fn

    custom = cfg.reward.custom_reward_function
    fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    return RewardManager(tokenizer, fn, num_workers=cfg.reward.num_workers)


class RunInputs(NamedTuple):
    """What the controller reads before any worker starts."""

    tokenizer: Any
    train_loader: Any
    val_loader: Any
    reward_fn: Any
    resume_from: Path | None = None
    """The checkpoint to continue from (trainer.resume_mode), checked before any worker starts."""


def _start_backend(cfg: RunConfig) -> None:
    """Ray: join the cluster at RAY_ADDRESS (started with `ray start` on every node), else start a local one."""
    if cfg.trainer.backend != "ray":
        return
    import ray

    from hybridflow.controller.ray import init_local_ray

    level = logging.INFO if cfg.trainer.verbose else logging.WARNING
    if os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=level)
        return
    init_local_ray(num_cpus=max(os.cpu_count() or 1, cfg.world_size * cfg.trainer.cpus_per_worker), logging_level=level)


def prepare_inputs(cfg: RunConfig) -> RunInputs:
    """Tokenizer, train/val loaders and reward function; every input problem surfaces here.

    Runs before any worker starts, so a bad model path, parquet file or batch size fails
    fast with one message and nothing is written to the checkpoint directory.
    """
    from hybridflow.models import load_tokenizer, resolve_model_path
    from hybridflow.trainer.data_setup import make_loaders

    path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or path)
    train_loader, val_loader = make_loaders(cfg.data, tokenizer)
    return RunInputs(tokenizer, train_loader, val_loader, make_reward_fn(cfg, tokenizer))


def load_run(config_path: str | None, overrides: Sequence[str]) -> tuple[ResolvedRun, RunInputs]:
    """Load, check and resolve a run and read its inputs; starts no worker."""
    from hybridflow.trainer.checkpointing import resume_path

    cfg = load_config(RunConfig, config_path, overrides)
    inputs = prepare_inputs(cfg)
    resolved = resolve(cfg, len(inputs.train_loader))
    return resolved, inputs._replace(resume_from=resume_path(resolved.config))


@contextmanager
def started_workers(
    cfg: Any,
    build: Callable[[], T],
    groups_of: Callable[[T], list],
    label: str,
    release: Callable[[T], None] = lambda built: None,
) -> Iterator[T]:
    """Start the backend and build the worker groups, load their models (one phase line each, libraries
    quiet unless trainer.verbose), yield what `build` returned; at exit shut every group down, then
    `release` what was built (free its placement)."""
    from hybridflow.utils.progress import phase
    from hybridflow.utils.quiet import quiet_libraries

    n = cfg.world_size
    with phase(f"starting {n} worker{'s' if n > 1 else ''} ({cfg.trainer.backend})"):
        _start_backend(cfg)
        built = build()
    try:
        with phase(label), quiet_libraries(cfg.trainer.verbose):
            for group in groups_of(built):
                group.init_model()
        yield built
    finally:
        for group in groups_of(built):
            group.shutdown()
        release(built)


def fit_with_restarts(
    cfg: Any,
    inputs: Any,
    build: Callable[[], T],
    groups_of: Callable[[T], list],
    label: str,
    release: Callable[[T], None],
    make_trainer: Callable[..., Any],
    carry: Callable[[Any, Any], None],
) -> tuple[Any, Any]:
    """Start the workers, `make_trainer(built, inputs, tracker, recovery).fit()`, and after a recoverable
    worker failure do it again from the newest checkpoint (trainer.max_restarts, trainer/recovery.py).

    `inputs`: RunInputs / SFTInputs (its resume_from is replaced per attempt); `carry(old, new)` moves what a
    restarted trainer keeps from the failed one (validation results: validation before training is not
    redone). Returns (the last trainer, what its fit returned)."""
    from hybridflow.trainer.recovery import Recovery, run_with_restarts
    from hybridflow.utils.tracking import Tracking

    recovery = Recovery(cfg.trainer, inputs.resume_from)
    loader_start = inputs.train_loader.state_dict()
    current: Any = None

    def attempt(built: T) -> Any:
        nonlocal current
        if recovery.resume_from is None:  # (re)starting at step 0: the loader too
            inputs.train_loader.load_state_dict(loader_start)
        fresh = make_trainer(built, inputs._replace(resume_from=recovery.resume_from), tracker, recovery)
        if current is not None:
            carry(current, fresh)
        current = fresh
        return fresh.fit()

    t = cfg.trainer
    with Tracking(t.project_name, t.experiment_name, t.logger, Path(t.log_dir), config=_plain(cfg)) as tracker:
        result = run_with_restarts(
            recovery,
            lambda: started_workers(cfg, build, groups_of, label, release),
            groups_of,
            attempt,
            lambda: current.global_step if current else 0,
            tracker.rewind,
        )
    return current, result


def run(resolved: ResolvedRun, inputs: RunInputs) -> dict[str, dict[str, float]]:
    """Train as resolved, recovering from worker failures; returns {"before": val metrics, "after": val metrics}."""
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from hybridflow.trainer.roles import Roles, build_roles

    def carry(old: PPOTrainer, new: PPOTrainer) -> None:
        new.first_val, new.last_val = old.first_val, old.last_val

    trainer, after = fit_with_restarts(
        resolved.config,
        inputs,
        lambda: build_roles(resolved),
        Roles.all,
        "loading models",
        lambda roles: roles.release(),
        lambda roles, run_inputs, tracker, recovery: PPOTrainer(resolved, roles, run_inputs, tracker, recovery),
        carry,
    )
    _report(Path(resolved.config.trainer.log_dir), trainer.first_val, after)
    return {"before": trainer.first_val, "after": after}


def _plain(cfg: RunConfig) -> dict:
    import yaml

    return yaml.safe_load(to_yaml(cfg))


def _report(log_dir: Path, before: dict[str, float], after: dict[str, float]) -> None:
    from hybridflow.planner.profile import write_profile
    from hybridflow.utils.plot import plot_run, summarize_run

    for key in sorted(set(before) | set(after)):
        print(f"{key}: before {before.get(key, float('nan')):.3f} -> after {after.get(key, float('nan')):.3f}")
    metrics_file = log_dir / "metrics.jsonl"
    if metrics_file.exists():
        print(summarize_run(metrics_file))
        print(f"plot: {plot_run(metrics_file, log_dir / 'run.png')}")
        profile = write_profile(log_dir)
        if profile is not None:
            print(f"profile: {profile}")


def parse_args(argv: Sequence[str], prog: str, description: str) -> argparse.Namespace:
    """`[--config FILE] [--print-config] key=value ...`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file with the run's config fields; key=value overrides apply on top")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved run (every derived value filled in) as YAML and exit",
    )
    parser.add_argument("overrides", nargs="*", help="verl-style overrides, e.g. actor.optim.lr=1e-5")
    return parser.parse_args(argv)


def run_command(argv: Sequence[str], prog: str, description: str, load: Any, execute: Any) -> int:
    """A trainer command: parse, `load(config, overrides)` -> (resolved, inputs), then `--print-config`
    or `execute(resolved, inputs)`. User errors print one line `<prog>: error: ...` and return 2."""
    # Our own info lines on the console; other libraries only warn (matplotlib's font cache, ...).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hybridflow").setLevel(logging.INFO)
    args = parse_args(argv, prog, description)
    try:
        resolved, inputs = load(args.config, args.overrides)
        if args.print_config:
            print(resolved.to_yaml(), end="")
            return 0
        check_writable(resolved.config)
    except USER_ERRORS as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    try:
        execute(resolved, inputs)
    except RunFailedError as err:  # its message names the failed worker and the command that resumes
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry of `hybridflow train`."""
    return run_command(
        sys.argv[1:] if argv is None else argv,
        "hybridflow train",
        "Train with PPO / GRPO / ... (see README).",
        load_run,
        run,
    )


if __name__ == "__main__":
    sys.exit(main())
