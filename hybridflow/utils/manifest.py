"""Checkpoint manifests: every file of a checkpoint with its size and SHA-256, checked before a resume.

`write_manifest(tmp_dir, step)` runs when a checkpoint is committed, after every
other file is written and before the COMPLETE marker (hybridflow/utils/checkpoint_dirs.py),
so the marker vouches for the manifest and the manifest for every byte. `find_damage`
re-reads the files; a checkpoint damaged after it was written (a truncated copy, a
bad disk, a file deleted by hand) is then reported and skipped instead of loaded.
The manifest is required: a directory without one is damaged, never "nothing to check".
The manifest file and its directory entry are fsynced before the marker is written.
SHA-256 runs at ~1.6 GB/s here: ~1 s for SmolLM2-135M's model + optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hybridflow.utils.atomic import fsync_dir

MANIFEST = "MANIFEST.json"
_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _listing(root: Path, skip: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in skip)


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest entry: the file's size and SHA-256."""
    return {"size": path.stat().st_size, "sha256": file_digest(path)}


def write_manifest(
    root: Path, step: int | None = None, skip: tuple[str, ...] = (), files: dict[str, Any] | None = None
) -> Path:
    """Write MANIFEST.json in `root` listing every file below it (but `skip`) with size and SHA-256, fsynced
    with its directory entry. `files`: entries already computed (by the processes that wrote those files);
    the entries of a subfolder's own manifest (an engine checkpoint inside a trainer one) are reused too, so
    each file is hashed once per save."""
    files = {**_nested_entries(root), **(files or {})}
    for p in _listing(root, skip + (MANIFEST,)):
        name = p.relative_to(root).as_posix()
        if name not in files:
            files[name] = file_entry(p)
    path = root / MANIFEST
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(root)
    return path


def _nested_entries(root: Path) -> dict[str, Any]:
    """The entries of the manifests in `root`'s subfolders, keyed by path from `root`, for files still of the
    recorded size."""
    out: dict[str, Any] = {}
    for nested in root.rglob(MANIFEST):
        if nested.parent == root:
            continue
        prefix = nested.parent.relative_to(root).as_posix()
        try:
            entries = json.loads(nested.read_text())["files"]
        except (ValueError, KeyError):
            continue
        for name, entry in entries.items():
            f = nested.parent / name
            if f.is_file() and f.stat().st_size == entry.get("size"):
                out[f"{prefix}/{name}"] = entry
    return out


def find_damage(root: Path, skip: tuple[str, ...] = (), under: str | None = None) -> str | None:
    """The first problem with `root` against its manifest, in one phrase naming the file, or None if every
    file checks out. `under`: check only the files below that subfolder of `root`.

    A directory without a manifest is damaged (an incomplete copy, or written before manifests existed).
    """
    path = root / MANIFEST
    if not path.is_file():
        return f"{MANIFEST} is missing (an incomplete copy, or a checkpoint written before manifests existed)"
    try:
        files = json.loads(path.read_text())["files"]
        files = {name: (int(w["size"]), str(w["sha256"])) for name, w in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its {MANIFEST} is unreadable ({type(err).__name__}: {err})"
    prefix = f"{under}/" if under else ""
    files = {name: want for name, want in files.items() if name.startswith(prefix)}
    for name, (size, sha256) in files.items():
        f = root / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
        if file_digest(f) != sha256:
            return f"{name} does not match its checksum"
    top = root / under if under else root
    present = [p.relative_to(root).as_posix() for p in _listing(top, ())]
    unknown = sorted(set(present) - set(files) - {f"{prefix}{s}" for s in skip} - {f"{prefix}{MANIFEST}"})
    return f"{unknown[0]} is not in the manifest" if unknown else None
