"""Peak memory of one operator in a worker: the process's RSS high-water mark (CPU) or CUDA's allocator peak.

`operator_peak(name, metrics)` resets the high-water mark before the operator (Linux: writing 5 to
/proc/self/clear_refs resets VmHWM; CUDA: torch.cuda.reset_peak_memory_stats) and records the peak
after it as metrics["memory/peak_gb/<name>"]. RSS counts everything the process holds (weights,
optimizer state, allocator caches), so it is the figure that decides whether a plan fits; where the
mark cannot be reset (not Linux) the lifetime peak is recorded instead, an upper bound.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterator

import torch

from hybridflow.utils.device import device_kind


def _reset_rss_peak() -> None:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # some sandboxes forbid it: the lifetime peak stays
            pass


def rss_peak_bytes() -> float:
    """The process's RSS high-water mark (since the last reset) in bytes."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


@contextlib.contextmanager
def operator_peak(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Record the peak memory of the enclosed operator as metrics["memory/peak_gb/<name>"] (GB)."""
    cuda = device_kind() == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_rss_peak()
    yield
    peak = torch.cuda.max_memory_allocated() if cuda else rss_peak_bytes()
    metrics[f"memory/peak_gb/{name}"] = peak / 1e9
