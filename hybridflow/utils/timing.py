"""Wall-clock timing of the trainer's phases, and turning metric values into floats.

Metric values arrive as Python numbers, numpy scalars/arrays or torch tensors
(possibly requiring grad); `to_float` and `reduce_metrics` accept all of them
without importing torch here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time the `with` block with `time.perf_counter` and store seconds in `timings[name]`.

    An existing entry is overwritten, not accumulated: one name per phase per
    step (the trainer turns them into `timing_s/<name>` metrics). The time is
    stored even when the block raises, so a failing step still shows where it
    spent its time.
    """
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start


def to_float(value: Any, key: str = "value") -> float:
    """One metric value (number, numpy scalar, one-element array or tensor) as a Python float."""
    array = _as_array(value, key)
    if array.size != 1:
        raise ValueError(
            f"metric {key!r} has {array.size} values, expected one number; reduce it first (e.g. reduce_metrics)"
        )
    return float(array.reshape(()))


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Mean of each metric's values: `{"actor/pg_loss": [0.1, 0.3]}` -> `{"actor/pg_loss": 0.2}`.

    Values may be lists/tuples of numbers or tensors, numpy arrays, tensors or
    plain scalars (a scalar is its own mean). An empty list is an error, because
    a metric with no samples means a caller forgot to record it.
    """
    reduced = {}
    for key, values in metrics.items():
        array = _as_array(values, key)
        if array.size == 0:
            raise ValueError(f"metric {key!r} has no values to reduce; record at least one value or drop the key")
        reduced[key] = float(array.mean())
    return reduced


def _as_array(value: Any, key: str) -> np.ndarray:
    """float64 numpy array of a number, array, tensor, or list/tuple of those."""
    if isinstance(value, (list, tuple)):
        parts = [_as_array(v, key).ravel() for v in value]
        return np.concatenate(parts) if parts else np.zeros(0)
    if hasattr(value, "detach"):  # torch.Tensor: detach first, it may require grad
        value = value.detach().float().cpu().numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r}: cannot turn {type(value).__name__} {value!r} into a number ({err})") from None
