"""The command line's argument definitions for `hybridflow train`, `sft` and `dpo`, importable without torch,
transformers or Ray, so that `hybridflow --help` and `hybridflow train --help` answer at once (cli/main.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)
"""What bad config, paths or data raise (config_loader.ConfigError and the registries' UnknownNameError are
ValueErrors); the CLI prints these as one line instead of a traceback. Any other exception is a bug: the CLI
prints one line and the path of a file holding its traceback (`report_unexpected`)."""

ROLLOUT_NAMES = ("native", "hf", "vllm")
"""The built-in rollout backends (`hybridflow generate --rollout`); the same as rollout/config.py's ROLLOUT_NAMES
(tests/test_cli_tools.py keeps them equal), here so the parser needs no torch."""

TRAIN_PROG, TRAIN_DESCRIPTION = "hybridflow train", "Train with PPO / GRPO / ... (see README)."
SFT_PROG, SFT_DESCRIPTION = "hybridflow sft", "Supervised fine-tuning (see README)."
DPO_PROG, DPO_DESCRIPTION = "hybridflow dpo", "Preference optimisation: DPO, IPO, hinge (see docs/guides/dpo.md)."


def parse_args(argv: Sequence[str] | None, prog: str, description: str) -> argparse.Namespace:
    """`[--config FILE] [--print-config] key=value ...` (sys.argv[1:] when `argv` is None); sets up the console
    log: our own info lines on stderr, other libraries' warnings only (matplotlib's font cache, ...)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hybridflow").setLevel(logging.INFO)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file with the run's config fields; key=value overrides apply on top")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved run (every derived value filled in) as YAML and exit",
    )
    parser.add_argument(
        "--list-keys",
        nargs="?",
        const="",
        metavar="PREFIX",
        help="print every config key (or those under PREFIX, e.g. actor.optim) with its type, default and doc; exit",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of any error")
    parser.add_argument("overrides", nargs="*", help="verl-style overrides, e.g. actor.optim.lr=1e-5")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def fail(prog: str, err: BaseException, code: int, debug: bool = False) -> int:
    """Print `<prog>: error: <err>` on stderr (after the traceback when `debug`); return `code`."""
    if debug:
        traceback.print_exception(err)
    print(f"{prog}: error: {err}", file=sys.stderr)
    return code


def traceback_file(err: BaseException, argv: Sequence[str]) -> Path:
    """Write the command line (`hybridflow` and its arguments `argv`) and `err`'s full traceback to a new file in
    `hybridflow-errors/` under the temp directory; its path."""
    folder = Path(tempfile.gettempdir()) / "hybridflow-errors"
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"{'-'.join(['hybridflow', *argv[:1]])}-{time.strftime('%Y%m%d-%H%M%S')}-"
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=folder, text=True)
    with os.fdopen(fd, "w") as file:
        file.write(f"command: {' '.join(['hybridflow', *argv])}\n\n" + "".join(traceback.format_exception(err)))
    return Path(name)


def report_unexpected(prog: str, err: BaseException, argv: Sequence[str], debug: bool) -> int:
    """An exception no command expects (a bug) in `hybridflow argv...`: with `debug` its traceback, else one line
    naming it and the file that holds its traceback (`traceback_file`), on stderr; returns exit code 1."""
    if debug:
        traceback.print_exception(err)
        return 1
    message = str(err).strip()
    summary = f"{type(err).__name__}: {message.splitlines()[0] if message else '(no message)'}"
    try:
        where = f"traceback in {traceback_file(err, argv)}"
    except OSError as write_err:  # an unwritable temp directory must not hide the error itself
        where = f"no traceback file ({write_err})"
    print(f"{prog}: error: {summary} [{where}; --debug prints it]", file=sys.stderr)
    return 1
