"""Files of plain data that `torch.load(weights_only=True)` reads back, so loading one runs no code.

`save_plain(path, obj)` writes tensors, dicts, lists, tuples, strings, numbers, booleans and None as they are,
and numpy arrays (object arrays of rows too) and numpy scalars as tagged dicts of those; `load_plain(path)`
reads the file with `weights_only=True` and turns the tags back into numpy. A value of any other type is
refused when saved, never pickled.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.utils.atomic import atomic_file

_ARRAY = "__ndarray__"
_SCALAR = "__npscalar__"


class NotPlainDataError(ValueError):
    """A value that a plain-data file cannot hold, or a file that holds something else."""


def to_plain(obj: Any) -> Any:
    """`obj` with every numpy array and scalar replaced by a tagged dict of plain values."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor)):
        return obj
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return {_ARRAY: "object", "shape": list(obj.shape), "items": [to_plain(x) for x in obj.reshape(-1)]}
        return {_ARRAY: str(obj.dtype), "shape": list(obj.shape), "items": obj.reshape(-1).tolist()}
    if isinstance(obj, np.generic):
        return {_SCALAR: str(obj.dtype), "value": obj.item()}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise NotPlainDataError(f"a dict with keys {list(obj)[:4]} is not plain data (str or int keys only)")
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(x) for x in obj)
    raise NotPlainDataError(f"a {type(obj).__module__}.{type(obj).__name__} is not plain data")


def from_plain(obj: Any) -> Any:
    """Inverse of `to_plain`."""
    if isinstance(obj, dict):
        if _ARRAY in obj:
            return _array(obj)
        if _SCALAR in obj:
            return np.dtype(obj[_SCALAR]).type(obj["value"])
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_plain(x) for x in obj)
    return obj


def _array(tagged: dict[str, Any]) -> np.ndarray:
    if tagged[_ARRAY] != "object":
        return np.asarray(tagged["items"], dtype=np.dtype(tagged[_ARRAY])).reshape(tagged["shape"])
    out = np.empty(len(tagged["items"]), dtype=object)
    for i, item in enumerate(tagged["items"]):  # one by one: numpy would turn equal-length lists into a 2-D array
        out[i] = from_plain(item)
    return out.reshape(tagged["shape"])


def save_plain(path: str | Path, obj: Any) -> None:
    """Write `obj` (see the module docstring for what it may hold) to `path` atomically."""
    with atomic_file(path, "wb") as f:
        torch.save(to_plain(obj), f)


def load_plain(path: str | Path) -> Any:
    """Read a `save_plain` file with `weights_only=True`; a file holding anything else is refused in one line."""
    try:
        return from_plain(torch.load(path, map_location="cpu", weights_only=True))
    except pickle.UnpicklingError:
        raise NotPlainDataError(
            f"{path} holds objects that are not plain data (written by an older hybridflow, or tampered with); "
            "resume from a checkpoint this version wrote"
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        raise NotPlainDataError(f"{path} is unreadable ({str(err).splitlines()[0]})") from None
