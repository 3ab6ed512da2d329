"""On-disk layout of trainer checkpoints, written so that a crash never leaves a usable-looking half checkpoint.

Layout: `<root>/global_step_<N>/` holds everything saved at step N (e.g.
`actor/`, `critic/` written by the engines, plus the trainer's own state
files). A checkpoint is *complete* only if it contains the marker file
`COMPLETE`, which is written last, after every other file was fsynced.

Saving goes through a temporary sibling directory (`hybridflow.utils.atomic`):

    tmp = begin_checkpoint(root, step)        # <root>/global_step_<N>.tmp-<pid>/
    ... engines save into tmp / "actor", tmp / "critic" (any rank, any process) ...
    ... the trainer writes its own state into tmp ...
    commit_checkpoint(tmp, step_dir(root, step))   # marker, then rename into place

or, in one process, `with atomic_dir(step_dir(root, step)) as tmp: ...`.
Only the controller calls these functions; worker ranks just write below the
path they are given (on several nodes, `root` must be on a shared filesystem).
Readers (`find_latest_complete`, `list_complete`) ignore `.tmp-*` directories
and directories without the marker, so a crash at any point falls back to
the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from hybridflow.utils import atomic
from hybridflow.utils.manifest import find_damage, write_manifest

STEP_DIR_PREFIX = "global_step_"
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
_TMP_DIR_RE = re.compile(r"^global_step_\d+\.tmp-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    """The final directory of the checkpoint of `step`: `<root>/global_step_<step>`."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return Path(root) / f"{STEP_DIR_PREFIX}{step}"


def checkpoint_step(path: str | Path) -> int | None:
    """The step N of a `global_step_<N>` directory name, or None for any other name."""
    match = _STEP_DIR_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | Path) -> bool:
    """True if `path` is a `global_step_<N>` directory holding the COMPLETE marker."""
    path = Path(path)
    return checkpoint_step(path) is not None and (path / COMPLETE_MARKER).is_file()


def list_complete(root: str | Path) -> list[Path]:
    """Every complete checkpoint directory under `root`, oldest step first ([] if root is missing)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: checkpoint_step(p))


def find_latest_complete(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None if there is none."""
    complete = list_complete(root)
    return complete[-1] if complete else None


def begin_checkpoint(root: str | Path, step: int) -> Path:
    """Create and return the empty temporary directory to save the checkpoint of `step` into."""
    return atomic.fresh_dir(atomic.temp_sibling(step_dir(root, step), _tag()))


def commit_checkpoint(tmp_path: str | Path, final_path: str | Path) -> Path:
    """Fsync everything in `tmp_path`, write the COMPLETE marker, and rename it to `final_path`.

    An existing `final_path` (the same step saved again after a resume) is
    replaced: it is first moved aside to `<name>.old-<pid>` and deleted after
    the rename, so a crash in between leaves the previous checkpoint as the
    latest complete one.
    """
    tmp_path, final_path = Path(tmp_path), Path(final_path)
    if not tmp_path.is_dir():
        raise FileNotFoundError(f"checkpoint temp dir {tmp_path} does not exist; create it with begin_checkpoint")
    return atomic.commit_dir(tmp_path, final_path, seal=_marker_writer(final_path))


def abort_checkpoint(tmp_path: str | Path) -> None:
    """Delete a temporary checkpoint directory that will not be committed."""
    shutil.rmtree(tmp_path, ignore_errors=True)


def atomic_dir(final_path: str | Path) -> AbstractContextManager[Path]:
    """Yield a temporary sibling of `final_path`; on success commit it (MANIFEST.json, then the marker),
    on exception delete it."""
    final_path = Path(final_path)
    marker = _marker_writer(final_path)

    def seal(tmp: Path) -> None:
        write_manifest(tmp, checkpoint_step(final_path))
        marker(tmp)

    return atomic.atomic_dir(final_path, tag=_tag(), seal=seal)


def damage(path: str | Path) -> str | None:
    """Why the complete checkpoint `path` cannot be trusted (a file missing, truncated or changed against
    its manifest), or None if it checks out."""
    return find_damage(Path(path), skip=(COMPLETE_MARKER,))


def find_latest_valid(root: str | Path, report: Callable[[Path, str], None]) -> Path | None:
    """The newest complete checkpoint under `root` whose files match its manifest; each newer damaged
    one is passed to `report(path, problem)` and skipped."""
    for path in reversed(list_complete(root)):
        problem = damage(path)
        if problem is None:
            return path
        report(path, problem)
    return None


def prune_checkpoints(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints; return what was deleted.

    Only complete `global_step_<N>` directories are candidates: temporary and
    incomplete directories, and anything else under `root`, are left alone.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is never pruned), got {keep_last}")
    doomed = list_complete(root)[:-keep_last]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def remove_stale_tmp(root: str | Path) -> list[Path]:
    """Delete `global_step_<N>.tmp-<pid>` directories left by crashed saves of other processes.

    Call it only from the single process that writes checkpoints under `root`
    (the trainer at start-up): a concurrent save of another run would be lost.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    stale = []
    for path in root.iterdir():
        match = _TMP_DIR_RE.match(path.name)
        if match and int(match.group(1)) != os.getpid():
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return sorted(stale)


def write_json_atomic(path: str | Path, obj: Any, default: Callable[[Any], Any] | None = None) -> Path:
    """Write `obj` as JSON to `path` through a temp file + fsync + rename, so readers never see half a file.

    `default` is passed to `json.dumps` (e.g. `str` to write Paths in a config).
    """
    text = json.dumps(obj, indent=2, default=default, allow_nan=True) + "\n"
    with atomic.atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def _tag() -> str:
    # The pid alone (not atomic's random tag): remove_stale_tmp tells other processes' leftovers by it.
    return str(os.getpid())


def _marker_writer(final_path: Path) -> Callable[[Path], None]:
    def write_marker(tmp_path: Path) -> None:
        marker = tmp_path / COMPLETE_MARKER
        marker.write_text(f"{final_path.name}\n")
        atomic.fsync_file(marker)

    return write_marker
