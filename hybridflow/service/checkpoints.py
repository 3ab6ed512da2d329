"""Tinker checkpoints: `tinker://RUN/weights/NAME` (adapter + optimizer) and `tinker://RUN/sampler_weights/NAME`
(adapter only), kept as files under the service's state directory: RUN/KIND/NAME/{adapter.safetensors,
optimizer.pt, meta.json}. RUN is the training client's model_id. Checkpoints outlive the clients (a freed
client's checkpoints stay loadable). Files are written to a temporary name and renamed, so a crash never
leaves a half-written checkpoint under a real name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from hybridflow.service.errors import UserError

KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""Path segment -> the checkpoint_type the SDK lists it as."""
NAME = re.compile(r"^[A-Za-z0-9._:\-]+$")


@dataclass(frozen=True)
class CheckpointPath:
    """A parsed `tinker://RUN/KIND/NAME`."""

    run: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.run}/{self.kind}/{self.name}"


def parse(path: str) -> CheckpointPath:
    """The parts of a tinker path; anything but exactly tinker://RUN/{weights|sampler_weights}/NAME is a UserError."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts) or not NAME.match(parts[2]):
        raise UserError(
            f"checkpoint path {path!r} is not tinker://RUN/weights/NAME or tinker://RUN/sampler_weights/NAME"
        )
    return CheckpointPath(*parts)


def check_name(name: str) -> None:
    """A checkpoint NAME: letters, digits and . _ : - only (it becomes one path segment)."""
    if not NAME.match(name) or name in (".", ".."):
        raise UserError(f"checkpoint name {name!r} must be letters, digits and . _ : - only")


class CheckpointStore:
    """Checkpoints on disk under `root` (module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, p: CheckpointPath) -> Path:
        return self.root / p.run / p.kind / p.name

    def exists(self, p: CheckpointPath) -> bool:
        return (self._dir(p) / "meta.json").is_file()

    def save(
        self,
        p: CheckpointPath,
        adapter: dict[str, Tensor],
        meta: dict,
        optimizer: dict | None = None,
        overwrite: bool = False,
    ) -> None:
        """Write the checkpoint; an existing one is a UserError unless `overwrite`."""
        if self.exists(p) and not overwrite:
            raise UserError(f"checkpoint {p} exists already; pick another name (or overwrite=True for weights)")
        final = self._dir(p)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(tmp / "adapter.safetensors"))
        if optimizer is not None:
            torch.save(optimizer, tmp / "optimizer.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "time": time.time()}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)

    def load(self, p: CheckpointPath) -> tuple[dict[str, Tensor], dict, dict | None]:
        """(adapter, meta, optimizer state or None) of a saved checkpoint; a missing one is a UserError."""
        if not self.exists(p):
            raise UserError(f"checkpoint {p} does not exist")
        d = self._dir(p)
        opt = d / "optimizer.pt"
        optimizer = torch.load(opt, weights_only=True) if opt.is_file() else None
        return load_file(str(d / "adapter.safetensors")), json.loads((d / "meta.json").read_text()), optimizer

    def list(self, run: str) -> list[dict]:
        """The run's checkpoints as the SDK's Checkpoint dicts."""
        out = []
        for kind, ctype in KINDS.items():
            for d in sorted((self.root / run / kind).glob("*/meta.json")):
                meta = json.loads(d.read_text())
                size = sum(f.stat().st_size for f in d.parent.iterdir())
                path = CheckpointPath(run, kind, d.parent.name)
                out.append(
                    {
                        "checkpoint_id": f"{kind}/{path.name}",
                        "checkpoint_type": ctype,
                        "time": meta["time"],
                        "tinker_path": str(path),
                        "size_bytes": size,
                    }
                )
        return out
