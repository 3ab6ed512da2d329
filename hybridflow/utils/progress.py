"""A tqdm progress bar for the training loop, showing a few key metrics as its postfix.

It switches itself off when its stream is not a terminal (logs, CI, Ray
drivers piped to files) or when the environment sets HYBRIDFLOW_NO_PROGRESS=1;
the console logger still prints one line per step then.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm

from hybridflow.utils.timing import to_float
from hybridflow.utils.tracking import key_metrics

NO_PROGRESS_ENV = "HYBRIDFLOW_NO_PROGRESS"
POSTFIX_LABELS = ("score", "pg_loss", "resp_len", "step_s")
"""Short labels (see tracking.KEY_METRICS) shown after the bar, when present."""


def progress_enabled(stream: TextIO, enable: bool | None = None) -> bool:
    """Whether to draw: never if HYBRIDFLOW_NO_PROGRESS=1, else `enable`, else "is `stream` a TTY"."""
    if os.environ.get(NO_PROGRESS_ENV, "") == "1":
        return False
    if enable is not None:
        return enable
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class TrainProgress:
    """Progress over training steps: `update(metrics)` once per step, `close()` at the end.

    `initial` is the step a resumed run starts from, so the bar shows the
    whole run. `enable=None` decides automatically (see `progress_enabled`).
    """

    def __init__(
        self,
        total_steps: int,
        initial: int = 0,
        desc: str = "train",
        stream: TextIO | None = None,
        enable: bool | None = None,
    ) -> None:
        stream = stream or sys.stderr
        self.enabled = progress_enabled(stream, enable)
        self._bar = tqdm(
            total=total_steps, initial=initial, desc=desc, file=stream, disable=not self.enabled, dynamic_ncols=True
        )

    def update(self, metrics: Mapping[str, Any] | None = None, steps: int = 1) -> None:
        """Advance by `steps` and show the key metrics found in `metrics`."""
        if not self.enabled:
            return
        if metrics:
            short = key_metrics(metrics, with_val=False)
            postfix = {k: f"{to_float(short[k], k):.4g}" for k in POSTFIX_LABELS if k in short}
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        """Finish the bar (leaves the last state on screen)."""
        self._bar.close()

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
