"""Value helpers behind DataProto: object arrays, the tensor <-> numpy codec used for
pickling, value equality, meta_info merging and key checks. No DataProto here, so this
module has no import cycle with `hybridflow.protocol`."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from hybridflow.protocol.keys import META_METRICS, META_PARITY

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def object_array(values: Any) -> np.ndarray:
    """`values` as a numpy object array of its length, without letting numpy nest lists."""
    if isinstance(values, np.ndarray):
        return values if values.dtype == object else values.astype(object)
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A CPU numpy array holding the tensor's bytes, plus the torch dtype name to restore."""
    tensor = tensor.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        return tensor.numpy(), dtype
    except TypeError:  # bf16, fp8, ...: numpy has no such dtype, ship the raw bits
        return tensor.view(_INT_VIEW[tensor.element_size()]).numpy(), dtype


def numpy_to_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of `tensor_to_numpy`."""
    if not array.flags.writeable:
        # Ray hands out read-only views of its shared object store; an in-place op on a
        # tensor over that memory would silently change the object for every other reader.
        array = array.copy()
    tensor = torch.from_numpy(array)
    target = getattr(torch, dtype)
    return tensor if tensor.dtype == target else tensor.view(target)


def same_value(a: Any, b: Any) -> bool:
    """Value equality for tensors, arrays and plain Python values (NaN equals NaN)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        both_nan = a.isnan() & b.isnan() if a.is_floating_point() else False
        return bool(((a == b.to(a.device)) | both_nan).all())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype != object and b.dtype != object:
            return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
        return all(same_value(x, y) for x, y in zip(a.flat, b.flat))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. lists holding arrays: ambiguous truth value
        return False


def merge_meta(metas: list[dict]) -> dict:
    """Merge the meta_info of parts being concatenated.

    A key with the same value everywhere keeps it. Under "metrics" a metric whose
    values differ between parts is gathered into one list (lists are extended);
    the parity findings' lists are concatenated; any other key whose values differ is an error.
    """
    merged: dict = {}
    for key in dict.fromkeys(k for m in metas for k in m):
        values = [m[key] for m in metas if key in m]
        if all(same_value(values[0], v) for v in values[1:]):
            merged[key] = values[0]
        elif key == META_METRICS and all(isinstance(v, dict) for v in values):
            merged[key] = merge_metrics(values)
        elif key == META_PARITY:
            merged[key] = [line for v in values for line in v]
        else:
            raise ValueError(
                f"DataProto.concat: meta_info[{key!r}] differs between parts ({values[:3]!r}...); "
                "make the parts agree or pop the key before concatenating"
            )
    return merged


def merge_metrics(parts: list[dict]) -> dict:
    """Metrics of several parts: equal values kept, differing ones gathered into a list."""
    merged: dict = {}
    for name in dict.fromkeys(k for p in parts for k in p):
        values = [p[name] for p in parts if name in p]
        if all(same_value(values[0], v) for v in values[1:]):
            merged[name] = values[0]
        else:
            merged[name] = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return merged


def as_list(keys: str | Iterable[str] | None) -> list[str]:
    """None -> [], one key -> [key], an iterable of keys -> list."""
    if keys is None:
        return []
    return [keys] if isinstance(keys, str) else list(keys)


def check_keys(kind: str, wanted: list[str], present: Iterable[str]) -> None:
    """Raise one KeyError naming every key of `wanted` missing from `present`."""
    present = list(present)
    missing = [k for k in wanted if k not in present]
    if missing:
        raise KeyError(f"{kind} has no key(s) {missing}; present keys: {present}")


def summarize(rows: int, batch: Any, non_tensor_batch: Mapping[str, np.ndarray], meta_info: Mapping[str, Any]) -> str:
    """`DataProto.summary`: every key of a DataProto's parts (its TensorDict `batch`, object arrays, meta keys)
    with its shape, dtype and size."""
    lines = [f"DataProto: {rows} rows"]
    total = 0
    for key, t in batch.items(include_nested=True, leaves_only=True):
        nbytes = t.numel() * t.element_size()
        total += nbytes
        lines.append(
            f"  batch[{key!r}]: {str(t.dtype).removeprefix('torch.')} {list(t.shape)} {nbytes / 2**20:.2f} MiB"
        )
    for key, v in non_tensor_batch.items():
        nbytes = v.nbytes + sum(sys.getsizeof(x) for x in v.flat)
        total += nbytes
        kinds = sorted({type(x).__name__ for x in v.flat[:64]})
        lines.append(
            f"  non_tensor_batch[{key!r}]: object {list(v.shape)} of {'/'.join(kinds) or '-'} ~{nbytes / 2**20:.2f} MiB"
        )
    lines.append(f"  meta_info keys: {list(meta_info)}")
    lines.append(f"  total ~{total / 2**20:.2f} MiB")
    return "\n".join(lines)
