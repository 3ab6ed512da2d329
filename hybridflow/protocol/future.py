"""DataProtoFuture (a DataProto still being computed by workers) and the padding
helpers that let a batch of any size be split over any number of workers.

Nothing here imports `hybridflow.protocol` or Ray at load time: `hybridflow.protocol`
re-exports these names, and importing it must not start Ray.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.protocol.proto import DataProto

if TYPE_CHECKING:
    import ray


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Append rows copied from the start of `data` (cycling if needed) until its length
    divides by `size_divisor`. Returns (padded, pad_size); `data` itself when pad_size is 0."""
    if size_divisor < 1:
        raise ValueError(f"pad_dataproto_to_divisor: size_divisor must be >= 1, got {size_divisor}")
    pad_size = -len(data) % size_divisor
    if pad_size == 0:
        return data, 0
    padding = data.select_idxs(torch.arange(pad_size) % len(data))
    return type(data).concat([data, padding]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows that `pad_dataproto_to_divisor` added."""
    if not 0 <= pad_size <= len(data):
        raise ValueError(f"unpad_dataproto: pad_size {pad_size} is outside [0, {len(data)}] (the batch size)")
    return data if pad_size == 0 else data.slice(0, len(data) - pad_size)


def _select_chunk(data: DataProto, index: int, chunks: int, before: Callable | None) -> DataProto:
    """Chunk `index` of `chunks` of `data` (after the earlier dispatch step `before`, if any)."""
    if before is not None:
        data = before(data)
    return data.chunk(chunks)[index]


@dataclass
class DataProtoFuture:
    """A DataProto that workers are still computing: object refs plus how to assemble them.

    Pass it into another worker-group call instead of a DataProto: each worker resolves the
    refs itself (`get()`), so the controller never waits for or holds the data.
    """

    collect_fn: Callable[[list[Any]], Any]
    """Turns the list of resolved refs into one value (usually `DataProto.concat`)."""
    futures: list[ray.ObjectRef]
    """The refs of the worker outputs, in worker order."""
    dispatch_fn: Callable[[Any], Any] | None = None
    """Applied after collect_fn, e.g. to pick this worker's chunk; None keeps the whole result."""
    fetch_fn: Callable[[list[Any]], list[Any]] | None = None
    """Resolves `futures` (None: `ray.get`); the Ray worker group's waits at most its call timeout and
    names the group, rank(s) and method of a failure or a timeout."""

    @staticmethod
    def concat(data: list[ray.ObjectRef]) -> DataProtoFuture:
        """A future of the concatenation of the DataProtos behind `data`."""
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(data))

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """`chunks` futures, the i-th resolving to chunk i of this one's result (nothing is fetched now)."""
        if chunks < 1:
            raise ValueError(f"DataProtoFuture.chunk: chunks must be >= 1, got {chunks}")
        return [
            DataProtoFuture(
                self.collect_fn,
                self.futures,
                functools.partial(_select_chunk, index=i, chunks=chunks, before=self.dispatch_fn),
                self.fetch_fn,
            )
            for i in range(chunks)
        ]

    def get(self) -> Any:
        """Wait for the refs, collect them and apply dispatch_fn."""
        if self.fetch_fn is None:
            import ray  # noqa: PLC0415  (lazy: the local backend runs without Ray)

            values = ray.get(self.futures)
        else:
            values = self.fetch_fn(self.futures)
        output = self.collect_fn(values)
        return output if self.dispatch_fn is None else self.dispatch_fn(output)
