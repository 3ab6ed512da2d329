"""Metric tracking: one `Tracking` object on the controller fans each step's metrics out to backends.

Backends (the `trainer.logger` list in the config):
- "console": one compact line per step with the key metrics (`KEY_METRICS`
  and every validation metric); the full metric dict goes to the Python
  logger `hybridflow.tracking` at DEBUG level.
- "jsonl": `<log_dir>/metrics.jsonl`, one JSON object per step
  (`{"step": N, "<metric>": value, ...}`), flushed every step and appended to
  on resume, after `rewind` dropped the records a resumed or recovered run redoes
  (each step is in the file once). Non-finite
  values are written as null so the file stays strict JSON. The run config,
  if given, goes to `<log_dir>/config.json`.
- "tensorboard": scalars under `<log_dir>/tensorboard/`; `rewind` reopens the writer with a
  purge step, so TensorBoard drops the redone steps' old events.
- "wandb", "mlflow": only when their packages are installed; they cannot rewind, so a redone
  step is logged to them twice (the later value is the one that counts).

Only the controller process tracks; workers return metrics in DataProto.meta_info.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, TextIO

from hybridflow.utils.atomic import atomic_file
from hybridflow.utils.checkpoint_dirs import write_json_atomic
from hybridflow.utils.registry import Registry
from hybridflow.utils.timing import to_float

_LOG = logging.getLogger("hybridflow.tracking")

KEY_METRICS: dict[str, str] = {
    "critic/score/mean": "score",
    "train/loss": "loss",
    "critic/rewards/mean": "reward",
    "actor/pg_loss": "pg_loss",
    "actor/kl_loss": "kl_loss",
    "critic/vf_loss": "vf_loss",
    "actor/entropy": "entropy",
    "response_length/mean": "resp_len",
    "timing_s/step": "step_s",
}
"""Metric key -> short label, in display order, for the console line and the progress bar."""

VAL_PREFIXES = ("val-core/", "val/")
"""Validation metrics with these prefixes are shown on the console and plotted ("val-aux/" is not)."""

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


def key_metrics(metrics: Mapping[str, float], with_val: bool = True) -> dict[str, float]:
    """The readable subset of `metrics`: `KEY_METRICS` under their short labels, then validation keys as is."""
    short = {label: metrics[key] for key, label in KEY_METRICS.items() if key in metrics}
    if with_val:
        short.update({k: v for k, v in sorted(metrics.items()) if k.startswith(VAL_PREFIXES)})
    return short


@dataclass
class RunInfo:
    """What every backend needs to know about the run."""

    project_name: str
    """Project (groups runs in wandb/mlflow)."""
    experiment_name: str
    """This run's name."""
    log_dir: Path
    """Directory for file-based backends (created if missing)."""
    config: dict[str, Any] | None = field(default=None)
    """The run's config as plain containers, recorded once at start (optional)."""


class Backend(Protocol):
    """A metric sink: `log` is called once per step with float values, `finish` once at the end.

    A backend that can forget what it logged after a step also has `rewind(step)` (see `Tracking.rewind`).
    """

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


def _rewind_jsonl(path: Path, step: int) -> None:
    """Drop the trailing records of `path` with a step above `step` (those a resumed run redoes).

    Only the trailing ones: records of an earlier run appended before this one's are kept.
    """
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    keep = len(lines)
    while keep and (not lines[keep - 1].strip() or json.loads(lines[keep - 1]).get("step", 0) > step):
        keep -= 1
    if keep < len(lines):
        with atomic_file(path, "w", encoding="utf-8") as f:
            f.writelines(lines[:keep])


class ConsoleBackend:
    """Prints `step N | score 0.53 | pg_loss -0.012 | ...` to stdout (or `stream`)."""

    def __init__(self, run: RunInfo, stream: TextIO | None = None) -> None:
        self._stream = stream

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Print the compact line; the full dict goes to DEBUG logging."""
        parts = [f"step {step}"] + [f"{k} {_fmt(v)}" for k, v in key_metrics(metrics).items()]
        print(" | ".join(parts), file=self._stream or sys.stdout, flush=True)
        if _LOG.isEnabledFor(logging.DEBUG):
            _LOG.debug("step %d metrics: %s", step, json.dumps(metrics, sort_keys=True))

    def finish(self) -> None:
        """Nothing to close."""


class JsonlBackend:
    """Appends one JSON object per step to `<log_dir>/metrics.jsonl`."""

    def __init__(self, run: RunInfo) -> None:
        run.log_dir.mkdir(parents=True, exist_ok=True)
        if run.config is not None:
            write_json_atomic(run.log_dir / CONFIG_FILE, run.config, default=str)
        self.path = run.log_dir / METRICS_FILE
        self._file = open(self.path, "a", encoding="utf-8")

    def rewind(self, step: int) -> None:
        """Drop the records after `step` that end the file; later records are appended after the rest."""
        self._file.close()
        _rewind_jsonl(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write and flush one line."""
        record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def finish(self) -> None:
        """Close the file."""
        self._file.close()


class TensorboardBackend:
    """Scalars (and the config as text) in `<log_dir>/tensorboard/`."""

    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (lazy: tensorboard is slow to import, only when asked for)

        self._dir = str(run.log_dir / "tensorboard")
        self._writer = SummaryWriter(log_dir=self._dir)
        if run.config is not None:
            text = json.dumps(run.config, indent=2, default=str)
            self._writer.add_text("config", "    " + text.replace("\n", "\n    "))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Add every metric as a scalar and flush, so a crash loses nothing logged."""
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def rewind(self, step: int) -> None:
        """Reopen the writer with purge_step=step+1: TensorBoard discards the earlier events of later steps."""
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (lazy: tensorboard is slow to import, only when asked for)

        self._writer.close()
        self._writer = SummaryWriter(log_dir=self._dir, purge_step=step + 1)

    def finish(self) -> None:
        """Close the event file."""
        self._writer.close()


class WandbBackend:
    """Weights & Biases run (needs `pip install wandb`)."""

    def __init__(self, run: RunInfo) -> None:
        wandb = _import_optional("wandb", "wandb")
        run.log_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=run.project_name, name=run.experiment_name, config=run.config, dir=str(run.log_dir)
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log the step's metrics."""
        self._run.log(metrics, step=step)

    def finish(self) -> None:
        """End the wandb run."""
        self._run.finish()


class MlflowBackend:
    """MLflow run in the experiment `project_name` (needs `pip install mlflow`)."""

    def __init__(self, run: RunInfo) -> None:
        self._mlflow = _import_optional("mlflow", "mlflow")
        self._mlflow.set_experiment(run.project_name)
        self._mlflow.start_run(run_name=run.experiment_name)
        if run.config is not None:
            self._mlflow.log_params(_flatten(run.config))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log the step's metrics; keys lose characters MLflow rejects ("@" -> "_at_")."""
        self._mlflow.log_metrics({_mlflow_key(k): v for k, v in metrics.items()}, step=step)

    def finish(self) -> None:
        """End the MLflow run."""
        self._mlflow.end_run()


BACKENDS: Registry[Callable[[RunInfo], Backend]] = Registry(
    "logger", "trainer.logger", "add one with hybridflow.utils.tracking.BACKENDS.register(name, cls)"
)
"""Logger name (as in the config's `trainer.logger` list) -> backend class."""
BACKENDS.register("console", ConsoleBackend)
BACKENDS.register("jsonl", JsonlBackend)
BACKENDS.register("tensorboard", TensorboardBackend)
BACKENDS.register("wandb", WandbBackend)
BACKENDS.register("mlflow", MlflowBackend)


class Tracking:
    """Sends each step's metrics to every requested backend.

    Values may be Python numbers, numpy scalars or one-element tensors; they
    are converted to floats once here. `config` must be plain containers
    (e.g. `OmegaConf.to_container(cfg, resolve=True)` or `dataclasses.asdict`).
    Use as a context manager or call `finish()` at the end (safe to call twice).
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        loggers: Iterable[str],
        log_dir: str | Path,
        config: dict[str, Any] | None = None,
    ) -> None:
        names = [loggers] if isinstance(loggers, str) else list(dict.fromkeys(loggers))
        makers = [BACKENDS.get(name) for name in names]
        self.run = RunInfo(project_name, experiment_name, Path(log_dir), config)
        self.backends: dict[str, Backend] = {}
        try:
            for name, make in zip(names, makers):
                self.backends[name] = make(self.run)
        except BaseException:
            self.finish()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Convert `metrics` to floats and hand them to every backend."""
        if "step" in metrics:
            raise ValueError("metric key 'step' is reserved (the step is the `step` argument); rename the metric")
        floats = {key: to_float(value, key) for key, value in metrics.items()}
        for backend in self.backends.values():
            backend.log(floats, int(step))

    def rewind(self, step: int) -> None:
        """A resumed or recovered run continues after `step`: backends that can (jsonl, tensorboard) drop
        what they logged after it, so the redone steps replace their first records instead of repeating them."""
        for backend in self.backends.values():
            rewind = getattr(backend, "rewind", None)
            if rewind is not None:
                rewind(int(step))

    def finish(self) -> None:
        """Close every backend (each at most once)."""
        while self.backends:
            _, backend = self.backends.popitem()
            backend.finish()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


def _fmt(value: float) -> str:
    """Four significant digits, compact."""
    return f"{value:.4g}"


def _import_optional(module: str, pip_name: str) -> ModuleType:
    """Import an optional backend package or fail with the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"logger {module!r} was requested in trainer.logger but the package is not installed; "
            f"run `pip install {pip_name}` or remove {module!r} from trainer.logger"
        ) from None


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"} with string values (MLflow params)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


def _mlflow_key(key: str) -> str:
    """A metric key MLflow accepts: alphanumerics, `_ - . / :` and spaces."""
    return re.sub(r"[^\w\-./: ]", "_", key.replace("@", "_at_"))
