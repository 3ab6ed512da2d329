"""Where hybridflow keeps what it measures or builds once per machine (model files, datasets, kernels, profiles)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Root of hybridflow's on-disk cache: $HYBRIDFLOW_CACHE or ~/.cache/hybridflow."""
    env = os.environ.get("HYBRIDFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybridflow"
