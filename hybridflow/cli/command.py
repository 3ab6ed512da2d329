"""The life of a training command (`hybridflow train`, `sft`, `dpo`) on parsed arguments, with its exit codes.

--list-keys prints the command's config keys; else the config is loaded, checked, measured and resolved, then
printed (--print-config: YAML only on stdout) or run. A bad config, path or data exits 2 with one line; a failure
the run cannot recover from (the command's `run_errors`) exits 1 with one line (--debug: each after its traceback).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.cli.args import USER_ERRORS, fail
from hybridflow.cli.list_keys import print_keys
from hybridflow.train.checkpointing import check_writable


def run_command(
    prog: str,
    kind: str,
    args: argparse.Namespace,
    load_run: Callable[[str | None, Sequence[str]], tuple[Any, Any]],
    run: Callable[[Any, Any], Any],
    run_errors: tuple[type[BaseException], ...],
) -> int:
    """Run one command (module docstring). `kind` names its key listing (list_keys.json); `load_run(config,
    overrides)` returns (resolved, inputs) without starting a worker; `run(resolved, inputs)` trains."""
    if args.list_keys is not None:
        return print_keys(kind, args.list_keys, prog, args.debug)
    try:
        resolved, inputs = load_run(args.config, args.overrides)
        if args.print_config:
            print(resolved.to_yaml(), end="")
            return 0
        check_writable(resolved.config)
    except USER_ERRORS as err:
        return fail(prog, err, 2, args.debug)
    try:
        run(resolved, inputs)
    except run_errors as err:  # one line: cause, fix
        return fail(prog, err, 1, args.debug)
    return 0
