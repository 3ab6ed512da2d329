"""DataProto: the batch that flows between the controller and the workers.

A DataProto holds one batch of B rows in three parts:

- `batch`: a TensorDict with one batch dimension (B); every tensor's dim 0 is B.
- `non_tensor_batch`: numpy object arrays of length B (strings, dicts, lists ...).
- `meta_info`: a plain dict for the whole batch: what the batch is, never what a worker should do
  (hybridflow/protocol/keys.py: the step it belongs to, the metrics a worker returned).

The keys the trainer uses are declared in `hybridflow.protocol.keys`. Pickling turns
each tensor into a numpy array (bf16 viewed as int16), so Ray ships every
tensor's bytes once, out of band, instead of going through torch's slow
per-storage pickling; a sliced view ships only its own rows.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridflow.protocol.values import (
    as_list,
    check_keys,
    merge_meta,
    numpy_to_tensor,
    object_array,
    same_value,
    summarize,
    tensor_to_numpy,
)
from hybridflow.protocol.verl import DataProtoConfig, DataProtoVerlMixin
from hybridflow.utils.atomic import atomic_file

IndexLike = Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor


@dataclass
class DataProtoItem:
    """One row of a DataProto: `batch` is a TensorDict with batch_size [] and
    `non_tensor_batch` holds that row's element of each object array."""

    batch: TensorDict
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto(DataProtoVerlMixin):
    """A batch of B rows: tensors, numpy object arrays and meta info (see module docstring)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: object_array(v) for k, v in (self.non_tensor_batch or {}).items()}
        self.meta_info = {} if self.meta_info is None else self.meta_info
        if self.batch is None:
            first = next(iter(self.non_tensor_batch.values()), None)
            self.batch = TensorDict({}, batch_size=[0 if first is None else len(first)])
        if not isinstance(self.batch, TensorDict) or self.batch.batch_dims != 1:
            raise ValueError(f"DataProto.batch must be a TensorDict with one batch dimension, got {self.batch!r}")
        self._check_lengths()

    def _check_lengths(self) -> None:
        sizes = {k: (v.shape[0] if v.ndim else None) for k, v in self.non_tensor_batch.items()}
        bad = {k: n for k, n in sizes.items() if n != len(self)}
        if bad:
            raise ValueError(
                f"DataProto: non_tensor_batch lengths {bad} differ from the batch size {len(self)} "
                f"(tensor keys {list(self.batch.keys())}); every key needs one entry per row"
            )

    # --- construction -------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from a dict of tensors (dim 0 = batch) and per-row values (`auto_padding`: see DataProtoConfig).
        verl's signature: `num_batch_dims` is accepted in verl's place but must be 1 (one batch dimension)."""
        if num_batch_dims != 1:
            raise ValueError(
                f"DataProto.from_dict: DataProto has one batch dimension, got num_batch_dims={num_batch_dims}"
            )
        tensors, non_tensors = tensors or {}, non_tensors or {}
        meta_info = {**(meta_info or {}), DataProtoConfig.auto_padding_key: True} if auto_padding else meta_info
        for key, value in non_tensors.items():
            if key in tensors or isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
                raise ValueError(
                    f"DataProto.from_dict: non_tensors[{key!r}] must be a per-row list or array "
                    "under a key not used by a tensor; put batch-wide values in meta_info"
                )
        sizes = {k: (v.shape[0] if v.dim() else None) for k, v in tensors.items()}
        sizes |= {k: len(v) for k, v in non_tensors.items()}
        if len(set(sizes.values())) > 1 or None in sizes.values():
            raise ValueError(
                f"DataProto.from_dict: keys have different batch sizes {sizes}; "
                "every tensor and list needs the same length along dim 0"
            )
        batch_size = [next(iter(sizes.values()), 0)]
        return cls(TensorDict(dict(tensors), batch_size=batch_size), dict(non_tensors), meta_info)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build from one dict: tensors go to `batch`, everything else to `non_tensor_batch`."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if k not in tensors}
        return cls.from_dict(tensors, others, meta_info, auto_padding=auto_padding)

    # --- indexing -------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    def __getitem__(self, item: int | slice | IndexLike) -> DataProtoItem | DataProto:
        """An int gives a DataProtoItem; a slice, index or bool mask gives a DataProto."""
        if isinstance(item, (int, np.integer)):
            if not -len(self) <= item < len(self):
                raise IndexError(f"DataProto index {item} out of range for length {len(self)}")
            return DataProtoItem(
                self.batch[int(item)], {k: v[item] for k, v in self.non_tensor_batch.items()}, self.meta_info
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto cannot be indexed by {type(item).__name__}")

    def select_idxs(self, idxs: IndexLike) -> DataProto:
        """Rows picked by integer indices or a boolean mask of length len(self)."""
        idx = torch.as_tensor(np.asarray(idxs) if isinstance(idxs, (list, tuple)) else idxs)
        if idx.dtype == torch.bool:
            if idx.shape != (len(self),):
                raise ValueError(
                    f"DataProto.select_idxs: bool mask of shape {tuple(idx.shape)} "
                    f"does not match the batch size {len(self)}"
                )
            idx = idx.nonzero().squeeze(-1)
        idx = idx.long().cpu().reshape(-1)
        np_idx = idx.numpy()
        return DataProto(
            self.batch[idx], {k: v[np_idx] for k, v in self.non_tensor_batch.items()}, dict(self.meta_info)
        )

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows start:end:step as views of this batch."""
        s = slice(start, end, step)
        return DataProto(self.batch[s], {k: v[s] for k, v in self.non_tensor_batch.items()}, dict(self.meta_info))

    # --- keys -------------------------------------------------------------------
    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the named keys (None keeps all keys of that part)."""
        b_keys = list(self.batch.keys()) if batch_keys is None else as_list(batch_keys)
        n_keys = list(self.non_tensor_batch) if non_tensor_batch_keys is None else as_list(non_tensor_batch_keys)
        m_keys = list(self.meta_info) if meta_info_keys is None else as_list(meta_info_keys)
        check_keys("DataProto.batch", b_keys, self.batch.keys())
        check_keys("DataProto.non_tensor_batch", n_keys, self.non_tensor_batch)
        check_keys("DataProto.meta_info", m_keys, self.meta_info)
        out = DataProto(
            self.batch.select(*b_keys),
            {k: self.non_tensor_batch[k] for k in n_keys},
            {k: self.meta_info[k] for k in m_keys},
        )
        if deepcopy:
            out = DataProto(out.batch.clone(), copy.deepcopy(out.non_tensor_batch), copy.deepcopy(out.meta_info))
        return out

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from this DataProto and return them as a new one."""
        b_keys, n_keys, m_keys = as_list(batch_keys), as_list(non_tensor_batch_keys), as_list(meta_info_keys)
        popped = self.select(b_keys, n_keys, m_keys)
        for k in b_keys:
            del self.batch[k]
        for k in n_keys:
            del self.non_tensor_batch[k]
        for k in m_keys:
            del self.meta_info[k]
        return popped

    def rename(self, old_keys: str | Iterable[str], new_keys: str | Iterable[str]) -> DataProto:
        """Rename batch or non_tensor_batch keys in place; returns self."""
        old, new = as_list(old_keys), as_list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"DataProto.rename: {len(old)} old keys {old} but {len(new)} new keys {new}")
        check_keys("DataProto (batch or non_tensor_batch)", old, [*self.batch.keys(), *self.non_tensor_batch])
        for o, n in zip(old, new):
            if o in self.non_tensor_batch:
                self.non_tensor_batch = {(n if k == o else k): v for k, v in self.non_tensor_batch.items()}
            else:
                self.batch.rename_key_(o, n)
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add other's keys to self in place; a key in both must hold equal values. Returns self."""
        if len(self) != len(other):
            raise ValueError(f"DataProto.union: batch sizes differ ({len(self)} vs {len(other)})")
        parts = [
            ("batch", self.batch, other.batch),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ]
        for part, mine, theirs in parts:
            for key in theirs.keys():
                if key in mine.keys() and not same_value(mine[key], theirs[key]):
                    raise ValueError(f"DataProto.union: {part}[{key!r}] differs between the two DataProtos")
        for key, value in other.batch.items():
            self.batch[key] = value
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        return self

    # --- splitting and joining --------------------------------------------------
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` equal parts (views); unequal ones only when `is_padding_enabled()` (verl)."""
        if chunks < 1:
            raise ValueError(f"DataProto.chunk: chunks must be >= 1, got {chunks}")
        if len(self) % chunks and self.is_padding_enabled():
            return self._uneven_chunk(chunks)
        if len(self) % chunks:
            raise ValueError(
                f"DataProto.chunk: batch size {len(self)} is not divisible by {chunks} chunks; "
                f"pad first with pad_dataproto_to_divisor(data, {chunks}) and unpad_dataproto the result"
            )
        size = len(self) // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of `split_size` rows (the last may be shorter)."""
        if split_size < 1:
            raise ValueError(f"DataProto.split: split_size must be >= 1, got {split_size}")
        starts = range(0, max(len(self), 1), split_size)
        return [self.slice(s, s + split_size) for s in starts]

    @classmethod
    def concat(cls, data: Sequence[DataProto]) -> DataProto:
        """Join DataProtos along the batch; meta_info is merged (see `merge_meta`)."""
        if not data:
            raise ValueError("DataProto.concat: got an empty list")
        keys0, nkeys0 = set(data[0].batch.keys()), set(data[0].non_tensor_batch)
        for i, d in enumerate(data):
            if set(d.batch.keys()) != keys0 or set(d.non_tensor_batch) != nkeys0:
                raise ValueError(
                    f"DataProto.concat: part {i} has keys {sorted(d.batch.keys())} + {sorted(d.non_tensor_batch)}"
                    f" but part 0 has {sorted(keys0)} + {sorted(nkeys0)}"
                )
        _check_row_shapes(data)
        batch = torch.cat([d.batch for d in data], dim=0)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in data[0].non_tensor_batch}
        return cls(batch, non_tensor, merge_meta([d.meta_info for d in data]))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row `repeat_times` times: [a a b b] if interleave else [a b a b]."""
        rows = torch.arange(len(self))
        idx = rows.repeat_interleave(repeat_times) if interleave else rows.repeat(repeat_times)
        return self.select_idxs(idx)

    def reorder(self, indices: IndexLike) -> None:
        """Permute the rows in place: row i becomes old row indices[i]."""
        idx = torch.as_tensor(np.asarray(indices)).long().reshape(-1).cpu()
        if not torch.equal(idx.sort().values, torch.arange(len(self))):
            raise ValueError(
                f"DataProto.reorder: indices must be a permutation of range({len(self)}), "
                f"got {len(idx)} indices {idx[:8].tolist()}..."
            )
        self.batch = self.batch[idx]
        self.non_tensor_batch = {k: v[idx.numpy()] for k, v in self.non_tensor_batch.items()}

    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensors to `device` in place; returns self."""
        self.batch = self.batch.to(device)
        return self

    # --- serialisation ----------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        tensors = {k: tensor_to_numpy(v) for k, v in self.batch.items(include_nested=True, leaves_only=True)}
        return {
            "length": len(self),
            "tensors": tensors,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = TensorDict({}, batch_size=[state["length"]])
        for key, (array, dtype) in state["tensors"].items():
            self.batch.set(key, numpy_to_tensor(array, dtype))
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def save_to_disk(self, path: str | os.PathLike) -> None:
        """Write to `path` atomically (temporary file in the same folder, then os.replace)."""
        with atomic_file(path, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load_from_disk(path: str | os.PathLike) -> DataProto:
        """Read a DataProto written by `save_to_disk` (a pickle: load only files you trust)."""
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{path} holds a {type(data).__name__}, not a DataProto")
        return data

    # --- display ------------------------------------------------------------------
    def summary(self) -> str:
        """Multi-line description: every key with its shape, dtype and size."""
        return summarize(len(self), self.batch, self.non_tensor_batch, self.meta_info)

    def print_size(self) -> str:
        """Print `summary()` and return it."""
        text = self.summary()
        print(text)
        return text

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for k, t in self.batch.items())
        return (
            f"DataProto(len={len(self)}, batch={{{tensors}}}, "
            f"non_tensor_batch={list(self.non_tensor_batch)}, meta_info={list(self.meta_info)})"
        )


def _check_row_shapes(data: Sequence[DataProto]) -> None:
    """Every tensor must have the same per-row shape and dtype in every part being concatenated."""
    for key, first in data[0].batch.items():
        for i, d in enumerate(data[1:], start=1):
            t = d.batch[key]
            if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                raise ValueError(
                    f"DataProto.concat: batch[{key!r}] is {t.dtype} {list(t.shape)} in part {i} but "
                    f"{first.dtype} {list(first.shape)} in part 0; only dim 0 may differ (pad to one width first)"
                )


def collate_fn(rows: Sequence[dict[str, Any]]) -> DataProto:
    """Rows (dicts with the same keys) to a DataProto: tensors stacked, other values in object arrays."""
    if not rows:
        raise ValueError("collate_fn: got no rows")
    keys = list(rows[0])
    for i, row in enumerate(rows):
        if set(row) != set(keys):
            raise KeyError(f"collate_fn: row {i} has keys {sorted(row)} but row 0 has {sorted(keys)}")
    tensors, others = {}, {}
    for key in keys:
        values = [row[key] for row in rows]
        if all(isinstance(v, torch.Tensor) for v in values):
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(f"collate_fn: tensors under {key!r} have different shapes {sorted(shapes)}")
            tensors[key] = torch.stack(values)
        else:
            others[key] = object_array(values)
    return DataProto.from_dict(tensors, others)


__all__ = ["DataProto", "DataProtoItem", "collate_fn"]
