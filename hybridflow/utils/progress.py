"""Console progress of a run: one line per phase, and a tqdm bar over training steps.

`phase` prints `loading models ... done in 12.3 s`: one line on a terminal, and in
a log file a start line and that result line, plain text without carriage returns.

`TrainProgress` shows a few key metrics as the bar's postfix. It switches itself
off when its stream is not a terminal (logs, CI, Ray drivers piped to files) or
when the environment sets HYBRIDFLOW_NO_PROGRESS=1; the console logger still
prints one line per step then.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

from hybridflow.utils.timing import to_float
from hybridflow.utils.tracking import key_metrics

NO_PROGRESS_ENV = "HYBRIDFLOW_NO_PROGRESS"
POSTFIX_LABELS = ("score", "loss", "pg_loss", "resp_len", "step_s")
"""Short labels (see tracking.KEY_METRICS) shown after the bar, when present."""
ERASE_TO_END_OF_LINE = "\x1b[K"
"""ANSI: clear the rest of the terminal line (after rewriting a phase line in place)."""


@contextmanager
def phase(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """Report a phase of the run on `stream` (default stdout): `what ... done in X s` (or `failed after X s`).

    On a terminal that is one line: `what ... ` while the block runs, rewritten in place
    when it ends, so output that came in between (a worker's warning) is not cut in two.
    Elsewhere (a log file) it is two plain lines, `what ...` and the result, with no
    carriage returns. Exceptions propagate.
    """
    out = stream or sys.stdout
    tty = is_tty(out)
    out.write(f"{what} ... " if tty else f"{what} ...\n")
    out.flush()
    start = time.perf_counter()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        result = f"{what} ... {outcome} {time.perf_counter() - start:.1f} s"
        out.write(f"\r{result}{ERASE_TO_END_OF_LINE}\n" if tty else f"{result}\n")
        out.flush()


def is_tty(stream: TextIO) -> bool:
    """Whether `stream` is a terminal."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress_enabled(stream: TextIO, enable: bool | None = None) -> bool:
    """Whether to draw: never if HYBRIDFLOW_NO_PROGRESS=1, else `enable`, else "is `stream` a TTY"."""
    if os.environ.get(NO_PROGRESS_ENV, "") == "1":
        return False
    if enable is not None:
        return enable
    return is_tty(stream)


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
