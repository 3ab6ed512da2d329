"""Reading an engine checkpoint's files without running any code they hold, and sealing them only when every
rank's files are there.

torch.distributed.checkpoint (DCP) reads its `.metadata` with `pickle.load` and every non-tensor item (the
optimizer's param-group settings) with `torch.load(weights_only=False)`: a checkpoint file could run code when
loaded. `SafeReader` unpickles `.metadata` allowing only DCP's own metadata classes, torch sizes, dtypes and
layouts, and `SafePlanner` reads the items with `weights_only=True`. The per-rank extra state
(`extra_rank{r}.pt`) is plain data read with `weights_only=True` too.

Sealing: each rank hashes the files it wrote (`__{rank}_*.distcp`, `extra_rank{rank}.pt`) and sends the entries to
rank 0, which checks that every rank reported, that every file `.metadata` points at is among them, and that each
is on its filesystem with the reported size, before it writes MANIFEST.json (fsynced) and the COMPLETE marker.
Loading (`damage`) checks the files against the manifest first: the engine directory's own, or that of the
trainer checkpoint around it (`<step>/actor/` in a checkpoint written before engines wrote their own).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from hybridflow.utils.manifest import MANIFEST, file_entry, find_damage, write_manifest

METADATA = ".metadata"
COMPLETE = "COMPLETE"
OLDER_VERSION = (
    "holds objects that are not plain data (written by an older hybridflow, or tampered with); if that version "
    "wrote it, export it with that version (`hybridflow export`) and start a run from the export"
)

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something other than plain data (code to run on load)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes a DCP `.metadata` file is made of; anything else is refused, never imported."""

    def __init__(self, file: Any, name: Path) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _DCP_CLASSES.get(module, ()) or (module == "torch" and _is_torch_value(name))
        if not allowed:
            raise UnsafeCheckpointError(
                f"{self.name} holds a pickled {module}.{name}, which no checkpoint contains; refusing to load it "
                "(a tampered or foreign file)"
            )
        return super().find_class(module, name)


def _is_torch_value(name: str) -> bool:
    return name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` unpickled through `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, path).load()
            except UnsafeCheckpointError:
                raise
            except Exception as err:  # a truncated or garbled file: any unpickling error
                raise UnsafeCheckpointError(f"{path} is not a readable checkpoint index ({err})") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint index")
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor items (optimizer settings) with `weights_only=True`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"item {read_item.dest_index.fqn} is not plain data ({err})") from None
        super().load_bytes(read_item, _saved(obj))


def _saved(obj: Any) -> io.BytesIO:
    """`obj` re-serialized, so DefaultLoadPlanner's own `load_bytes` only ever sees bytes this process wrote."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def load_extra(path: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s extra state file (LR schedule and the caller's `extra`), as plain data."""
    file = path / f"extra_rank{rank}.pt"
    if not file.is_file():
        raise UnsafeCheckpointError(f"{file} is missing: rank {rank} of the run that wrote {path} saved no state")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UnsafeCheckpointError(f"{file} {OLDER_VERSION}") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise UnsafeCheckpointError(f"{file} is unreadable ({str(err).splitlines()[0]})") from None


def own_entries(tmp: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Manifest entries of the files rank `rank` wrote into `tmp` (its shards and its extra state)."""
    mine = sorted(tmp.glob(f"__{rank}_*.distcp")) + [tmp / f"extra_rank{rank}.pt"]
    return {p.name: file_entry(p) for p in mine if p.is_file()}


def gather_entries(tmp: Path, rank: int, world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's `own_entries`, on rank 0 (None on the others)."""
    entries = own_entries(tmp, rank)
    if not dist.is_initialized() or world_size == 1:
        return [entries]
    gathered: list[Any] = [None] * world_size if rank == 0 else None
    dist.gather_object(entries, gathered, dst=0)
    return gathered


def missing_rank_file(tmp: Path, reports: list[dict[str, Any]]) -> str | None:
    """On rank 0 before sealing: the first file a rank did not write, or that is not here as that rank wrote it;
    None when every rank's files are present."""
    for rank, entries in enumerate(reports):
        if f"extra_rank{rank}.pt" not in entries:
            return f"extra_rank{rank}.pt of rank {rank} was not written"
        for name, want in entries.items():
            f = tmp / name
            if not f.is_file():
                return f"{name} of rank {rank} is not visible to rank 0 (is the checkpoint directory shared?)"
            if f.stat().st_size != want["size"]:
                return f"{name} of rank {rank} has {f.stat().st_size} bytes here, rank {rank} wrote {want['size']}"
    reported = {name for entries in reports for name in entries}
    metadata = SafeReader(tmp).read_metadata()
    shards = sorted({info.relative_path for info in metadata.storage_data.values()} - reported)
    return f"{shards[0]} is in {METADATA} but no rank reported writing it" if shards else None


def write_engine_manifest(tmp: Path, reports: list[dict[str, Any]]) -> None:
    """MANIFEST.json of an engine checkpoint: the ranks' own entries plus rank 0's files (fsynced)."""
    entries = {name: entry for report in reports for name, entry in report.items()}
    write_manifest(tmp, skip=(COMPLETE,), files=entries)


def damage(path: Path) -> str | None:
    """Why the engine checkpoint `path` cannot be trusted against its manifest (its own, or the trainer
    checkpoint's around it), in one phrase naming the file; None when every file checks out."""
    if (path / MANIFEST).is_file() or not (path.parent / MANIFEST).is_file():
        return find_damage(path, skip=(COMPLETE,))
    return find_damage(path.parent, skip=(COMPLETE,), under=path.name)
