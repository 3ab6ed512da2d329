"""verl's DataProto helpers under hybridflow, with verl's signatures and meanings.

The free functions (`union_tensor_dict`, `union_numpy_dict`, the tensor codec, `DataProtoConfig`) and
`DataProtoVerlMixin`, the methods DataProto gains from verl (`make_iterator`, `padding`,
`sample_level_repeat`, `unfold_column_chunks`, `to_tensordict` / `from_tensordict`). All are
re-exported by `hybridflow.protocol`; see docs/verl_runtime.md for where they depart from verl
(ValueError where verl asserts). No DataProto import here: no cycle with `hybridflow.protocol`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torch.utils.data import DataLoader

from hybridflow.protocol.values import same_value

__all__ = [
    "DataProtoConfig",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "serialize_single_tensor",
    "serialize_tensordict",
    "union_numpy_dict",
    "union_tensor_dict",
]

AUTO_PADDING_ENV = "VERL_AUTO_PADDING"


class _DataProtoConfigMeta(type):
    _config: dict[str, bool] = {}
    auto_padding_key = "_verl_auto_padding"

    @property
    def auto_padding(cls) -> bool:
        """On when VERL_AUTO_PADDING is TRUE/1 or it was set to True."""
        by_env = os.getenv(AUTO_PADDING_ENV, "FALSE").upper() in ("TRUE", "1")
        return by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    """Process-wide DataProto settings: `DataProtoConfig.auto_padding = True` lets every DataProto
    `chunk` into parts of unequal size (as `from_dict(..., auto_padding=True)` does for one batch)."""


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add `tensor_dict2`'s keys to `tensor_dict1` in place and return it; a shared key must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"union_tensor_dict: batch sizes differ ({tensor_dict1.batch_size} and {tensor_dict2.batch_size})"
        )
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2[key]
        elif not tensor_dict1[key].equal(tensor_dict2[key]):
            raise ValueError(f"union_tensor_dict: {key!r} differs between the two tensor dicts")
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add `tensor_dict2`'s arrays to `tensor_dict1` in place and return it; a shared key must hold
    equal arrays (NaN equals NaN, object arrays compared element by element)."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            if not (isinstance(value, np.ndarray) and isinstance(tensor_dict1[key], np.ndarray)):
                raise TypeError(f"union_numpy_dict: {key!r} must be a numpy array in both dicts")
            if not same_value(tensor_dict1[key], value):
                raise ValueError(f"union_numpy_dict: {key!r} differs between the two dicts")
        tensor_dict1[key] = value
    return tensor_dict1


def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype name, shape, the tensor's bytes as a flat uint8 numpy array); the tensor must be on the CPU."""
    data = obj.flatten().contiguous().view(torch.uint8).numpy()
    return str(obj.dtype).removeprefix("torch."), obj.shape, data


def deserialize_single_tensor(arr: tuple[str, Sequence[int], Any]) -> torch.Tensor:
    """Inverse of `serialize_single_tensor`: a new tensor owning a copy of the bytes."""
    dtype, shape, data = arr
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"deserialize_single_tensor: {dtype!r} is not a torch dtype")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(torch_dtype).view(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """(batch size, device name or None, {key: encoded tensor}); a nested tensor is (layout, [parts])."""
    items: dict[str, tuple] = {}
    for key, value in batch.items():
        if value.is_nested:
            items[key] = (
                str(value.layout).removeprefix("torch."),
                [serialize_single_tensor(t) for t in value.unbind()],
            )
        else:
            items[key] = serialize_single_tensor(value)
    device = str(batch.device) if batch.device is not None else None
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(arr: tuple) -> TensorDict:
    """Inverse of `serialize_tensordict`."""
    batch_size, device, items = arr
    decoded: dict[str, torch.Tensor] = {}
    for key, value in items.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, parts = value
            tensors = [deserialize_single_tensor(p) for p in parts]
            decoded[key] = torch.nested.as_nested_tensor(tensors, layout=getattr(torch, layout))
        else:
            raise ValueError(f"deserialize_tensordict: {key!r} has an encoding of length {len(value)}, not 2 or 3")
    return TensorDict(source=decoded, batch_size=batch_size, device=device)


def _repeat_counts(repeat_times: Any) -> torch.Tensor:
    if isinstance(repeat_times, (torch.Tensor, np.ndarray)) and repeat_times.ndim != 1:
        raise ValueError(f"sample_level_repeat: repeat_times must be 1-D, got shape {tuple(repeat_times.shape)}")
    if not isinstance(repeat_times, (list, tuple, torch.Tensor, np.ndarray)):
        raise TypeError(
            f"sample_level_repeat: repeat_times must be a list, tuple, tensor or array, got {type(repeat_times)}"
        )
    return torch.as_tensor(np.asarray(repeat_times.tolist() if hasattr(repeat_times, "tolist") else repeat_times))


class DataProtoVerlMixin:
    """verl's DataProto methods; DataProto inherits them (`self` has batch, non_tensor_batch, meta_info)."""

    def is_padding_enabled(self) -> bool:
        """Whether `chunk` may make parts of unequal size (this batch's auto_padding, or DataProtoConfig's)."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def _uneven_chunk(self, chunks: int) -> list:
        """verl's auto-padding chunk: parts of ceil(len/chunks) rows, the last ones shorter."""
        size = -(-len(self) // chunks)
        if size * (chunks - 1) >= len(self) and len(self):
            raise ValueError(
                f"DataProto.chunk: {len(self)} rows cannot make {chunks} non-empty parts of {size} rows "
                "(verl splits like torch.chunk); pad with pad_dataproto_to_divisor instead"
            )
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append `padding_size` copies of the first row ("first") or of the last (anything else), in place."""
        if padding_size == 0:
            return
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = type(self).concat([self, self.select_idxs([row] * padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def make_iterator(
        self, mini_batch_size: int, epochs: int, seed: int | None = None, dataloader_kwargs: dict | None = None
    ) -> Iterator:
        """Mini-batches of `mini_batch_size` rows for `epochs` passes (len(self) must divide by it), each
        with this batch's meta_info; `dataloader_kwargs` go to torch's DataLoader (e.g. shuffle=True),
        whose shuffling `seed` makes reproducible."""
        if len(self) % mini_batch_size:
            raise ValueError(f"make_iterator: batch size {len(self)} is not divisible by {mini_batch_size}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        loader = DataLoader(
            range(len(self)),
            batch_size=mini_batch_size,
            collate_fn=torch.tensor,
            generator=generator,
            **(dataloader_kwargs or {}),
        )

        def batches() -> Iterator:
            for _ in range(epochs):
                for idx in loader:
                    part = self.select_idxs(idx)
                    part.meta_info = self.meta_info
                    yield part

        return iter(batches())

    def sample_level_repeat(self, repeat_times: Any) -> Any:
        """Row i repeated `repeat_times[i]` times, rows kept in order (a list, tuple, 1-D tensor or array)."""
        counts = _repeat_counts(repeat_times)
        if len(counts) != len(self):
            raise ValueError(f"sample_level_repeat: {len(counts)} repeat counts for {len(self)} rows")
        return self.select_idxs(torch.arange(len(self)).repeat_interleave(counts))

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> Any:
        """Split dim 1 of each `split_keys` entry into `n_split` parts moved to the batch dim
        ((B, n*k, ...) -> (B*n, k, ...)); every other key repeats each row `n_split` times."""
        split_keys = split_keys or []

        def unfold(value: Any) -> Any:
            shape = (value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])
            return value.reshape(shape)

        tensors = {
            k: unfold(v) if k in split_keys else v.repeat_interleave(n_split, dim=0) for k, v in self.batch.items()
        }
        batch = TensorDict(tensors, batch_size=[len(self) * n_split], device=self.batch.device)
        others = {
            k: unfold(v) if k in split_keys else np.repeat(v, n_split, axis=0) for k, v in self.non_tensor_batch.items()
        }
        return type(self)(batch, others, self.meta_info)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: the tensors, each non-tensor key as a NonTensorStack of its rows, each
        meta_info key as NonTensorData (`from_tensordict` reverses it)."""
        common = set(self.batch.keys()) & set(self.non_tensor_batch)
        if common:
            raise ValueError(f"to_tensordict: keys {sorted(common)} are both tensors and non-tensors")
        out = TensorDict(self.batch.to_dict(), batch_size=self.batch.batch_size)
        for key, values in self.non_tensor_batch.items():
            out[key] = NonTensorStack.from_list([NonTensorData(v) for v in values])
        for key, value in self.meta_info.items():
            out[key] = NonTensorData(value)
        return out

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1) -> Any:
        """Inverse of `to_tensordict`: tensors to `batch`, NonTensorStacks to `non_tensor_batch`,
        NonTensorData to `meta_info` (added to `meta_info` when given). Only `num_batch_dims=1`."""
        if num_batch_dims != 1:
            raise ValueError(f"from_tensordict: DataProto has one batch dimension, got num_batch_dims={num_batch_dims}")
        meta_info = {} if meta_info is None else meta_info
        tensors, others = {}, {}
        for key in tensor_dict.keys():
            value = tensor_dict.get(key)
            if isinstance(value, NonTensorStack):
                others[key] = np.array([v.data if isinstance(v, NonTensorData) else v for v in value], dtype=object)
            elif isinstance(value, NonTensorData):
                meta_info[key] = value.data
            elif isinstance(value, torch.Tensor):
                tensors[key] = value
        batch = TensorDict(tensors, batch_size=tensor_dict.batch_size[:1])
        return cls(batch, others, meta_info)
