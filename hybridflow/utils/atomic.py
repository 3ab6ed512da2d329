"""Write files and directories so that no reader ever sees them half-written.

Everything is written under a temporary sibling name in the same folder,
`<name>.tmp-<tag>`, flushed to disk, and renamed into place by one
`os.replace` (atomic within a filesystem); a failure removes the temporary.
Code that scans a folder must skip names containing `.tmp-` (and `.old-`,
the name a replaced directory has for a moment).

    with atomic_file(path, "wb") as f:          # one file
        pickle.dump(obj, f)

    with atomic_dir(out) as tmp:                # one directory, built in one process
        model.save_pretrained(tmp)

Several processes filling one directory use the two halves: every process
writes below `temp_sibling(final, tag)` (a tag they agree on), then one of
them calls `commit_dir` (see `hybridflow.utils.checkpoint_dirs`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TMP_INFIX = ".tmp-"
OLD_INFIX = ".old-"


def unique_tag() -> str:
    """A tag no other writer uses: this process id plus a random part (threads of one process differ)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temp_sibling(final: str | Path, tag: str | None = None) -> Path:
    """`<final>.tmp-<tag>` in the folder of `final` (tag: `unique_tag()`)."""
    final = Path(final)
    return final.with_name(f"{final.name}{TMP_INFIX}{tag or unique_tag()}")


@contextmanager
def atomic_file(path: str | Path, mode: str = "w", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Yield a new file open for writing ("w" or "wb"); on success it replaces `path`, on exception it is deleted.

    The parent folder is created if missing. The data is fsynced before the rename.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file writes a whole file: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, mode.replace("w", "x"), encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fresh_dir(path: str | Path) -> Path:
    """Create `path` empty (and its parents), deleting what a failed earlier write left there."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def commit_dir(
    tmp: str | Path, final: str | Path, seal: Callable[[Path], None] | None = None, replace: bool = True
) -> Path:
    """Fsync every file below `tmp`, call `seal(tmp)`, and rename `tmp` to `final`.

    `seal` runs once the contents are on disk, just before the rename: it writes
    what may only exist beside complete contents (a COMPLETE marker).
    An existing `final` is replaced (`replace`): it is first moved aside to
    `<final>.old-<pid>` and deleted after the rename, so a crash in between
    leaves the old directory in place. With `replace=False` an existing
    `final` (another writer finished first) is kept and `tmp` deleted.
    """
    tmp, final = Path(tmp), Path(final)
    for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
        fsync_file(file)
    if seal is not None:
        seal(tmp)
    if not replace:
        return _rename_unless_present(tmp, final)
    old = final.with_name(f"{final.name}{OLD_INFIX}{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


@contextmanager
def atomic_dir(
    final: str | Path, tag: str | None = None, seal: Callable[[Path], None] | None = None, replace: bool = True
) -> Iterator[Path]:
    """Yield an empty `temp_sibling(final, tag)`; on success `commit_dir` it to `final`, on exception delete it."""
    tmp = fresh_dir(temp_sibling(final, tag))
    try:
        yield tmp
        commit_dir(tmp, final, seal, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fsync_file(path: str | Path) -> None:
    """Flush one file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename) to disk where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rename_unless_present(tmp: Path, final: Path) -> Path:
    try:
        os.rename(tmp, final)  # fails when final is a non-empty directory
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return final
    fsync_dir(final.parent)
    return final
