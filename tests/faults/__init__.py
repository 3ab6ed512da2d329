"""Fault injection for tests: what to break, when and how, filled into the hook points of hybridflow/utils/hooks.py.

Two kinds (each module's docstring gives its spec):
- worker faults (calls.py): "update_actor@3:1[:kill|hang]": a rank kills itself or hangs entering a method at a
  step, once (markers under `marker_dir`);
- parity faults (parity.py): "skip_sync@2,token_edit@3": break one thing at one step for the parity guard.

In this process: `arm(...)` / `disarm()`, or `with armed(...):`. In every process of a run (the controller, each
Ray worker, the workers a recovery restarts): `plugin_file(dir, ...)` writes a `trainer.plugins` module that arms
the same faults where it is imported; pass `plugin_override(...)` on the run's command line. A malformed spec is
refused when the file is written, before any run starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridflow.utils import hooks

from .calls import method_entered_hook, parse_faults
from .parity import ParityFaults, parse_parity_faults

TESTS_DIR = Path(__file__).resolve().parent.parent
"""tests/: what a plugin puts on sys.path to import this package in a worker process."""
POINT_NAMES = (
    "worker.method_entered",
    "weight_sync.keep_copy",
    "weight_sync.before_load",
    "weight_sync.skip_load",
    "weight_sync.reshard_layout",
    "weight_sync.loaded",
    "rollout.generated",
    "vllm.skip_prefix_cache_reset",
)
"""Every hook point the faults fill (test_fault_hooks.py checks each is declared by the code)."""


def arm(calls: str = "", marker_dir: str | Path | None = None, parity: str = "") -> None:
    """Install the hooks of worker-fault spec `calls` (once-markers in `marker_dir`, required with it) and
    parity-fault spec `parity` in this process."""
    if calls:
        if marker_dir is None:
            raise ValueError("worker faults need a marker_dir for their once-markers")
        hooks.install("worker.method_entered", method_entered_hook(calls, marker_dir))
    if parity:
        for name, hook in ParityFaults(parity).hooks().items():
            hooks.install(name, hook)


def disarm() -> None:
    """Empty every point the faults may have filled in this process."""
    for name in POINT_NAMES:
        hooks.uninstall(name)


@contextmanager
def armed(calls: str = "", marker_dir: str | Path | None = None, parity: str = "") -> Iterator[None]:
    """`arm` for the block, `disarm` after it."""
    arm(calls, marker_dir, parity)
    try:
        yield
    finally:
        disarm()


def plugin_file(directory: Path, calls: str = "", marker_dir: str | Path | None = None, parity: str = "") -> Path:
    """Write `directory/fault_plugin.py`, a trainer.plugins module that arms these faults wherever it is imported."""
    parse_faults(calls)
    parse_parity_faults(parity)
    if calls and marker_dir is None:
        raise ValueError("worker faults need a marker_dir for their once-markers")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fault_plugin.py"
    marker = None if marker_dir is None else str(marker_dir)
    path.write_text(
        '"""Arms the test\'s faults in this process (written by tests/faults)."""\n'
        "import sys\n\n"
        f"if {str(TESTS_DIR)!r} not in sys.path:\n"
        f"    sys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from faults import arm\n\n"
        f"arm(calls={calls!r}, marker_dir={marker!r}, parity={parity!r})\n"
    )
    return path


def plugin_override(directory: Path, calls: str = "", marker_dir: str | Path | None = None, parity: str = "") -> str:
    """The `trainer.plugins=[...]` override of a run armed with these faults (`plugin_file`)."""
    return f"trainer.plugins=[{plugin_file(directory, calls, marker_dir, parity)}]"
