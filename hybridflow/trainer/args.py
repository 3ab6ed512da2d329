"""The command line's argument definitions for `hybridflow train` and `hybridflow sft`, importable without torch,
transformers or Ray, so that `hybridflow --help` and `hybridflow train --help` answer at once (trainer/cli.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

USER_ERRORS = (ValueError, KeyError, TypeError, FileNotFoundError, NotADirectoryError)
"""What bad config, paths or data raise; the CLI prints these as one line instead of a traceback."""

ROLLOUT_NAMES = ("native", "hf", "vllm")
"""The built-in rollout backends (`hybridflow generate --rollout`); the same as rollout/config.py's ROLLOUT_NAMES
(tests/test_cli_tools.py keeps them equal), here so the parser needs no torch."""

TRAIN_PROG, TRAIN_DESCRIPTION = "hybridflow train", "Train with PPO / GRPO / ... (see README)."
SFT_PROG, SFT_DESCRIPTION = "hybridflow sft", "Supervised fine-tuning (see README)."


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
    parser.add_argument("overrides", nargs="*", help="verl-style overrides, e.g. actor.optim.lr=1e-5")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def fail(prog: str, err: BaseException, code: int) -> int:
    """Print `<prog>: error: <err>` (one line, no traceback) on stderr; return `code`."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return code
