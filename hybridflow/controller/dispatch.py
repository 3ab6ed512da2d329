"""The built-in dispatch and collect functions behind `Dispatch`.

A dispatch function takes `(worker_group, *args, **kwargs)` and returns
`(args, kwargs)` in which every value is a list with one entry per rank (or
one entry, for rank-zero execution). It may add the reserved keyword
`PAD_SIZE_KEY`: the number of padding rows it appended to split a batch
evenly; the WorkerGroup pops it and drops those rows from the collected result.

A collect function takes `(group, outputs)`, the per-rank outputs in rank
order. `group` may be a `GroupInfo` snapshot rather than the WorkerGroup
itself, so that a future carrying the collect function stays picklable; it
offers `world_size` and `get_dispatch_info(mesh_name)`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict

from hybridflow.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor

PAD_SIZE_KEY = "_hybridflow_pad_size"


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch ops on one thread inside the block.

    Concatenating or padding shards on the controller is a memory copy that
    extra threads do not speed up; when the workers keep every core busy, an
    OpenMP barrier across threads instead stalls for a scheduler time slice
    (measured: 2 MiB torch.cat 0.75 ms on one thread vs ~5 ms on two).
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _is_proto(x: Any) -> bool:
    return isinstance(x, DataProto)


def _is_future(x: Any) -> bool:
    return isinstance(x, DataProtoFuture)


def dispatch_one_to_all(wg: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Send every argument, unchanged, to every rank."""
    n = wg.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def _check_per_rank(name: str, value: Any, n: int) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = type(value).__name__
        if hasattr(value, "__len__"):
            got += f" of length {len(value)}"
        raise ValueError(
            f"argument {name} must be a list with one entry per rank ({n} ranks), got a {got}; "
            "split it yourself or use Dispatch.ONE_TO_ALL / DP_COMPUTE_PROTO"
        )


def dispatch_all_to_all(wg: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Arguments are already lists with one entry per rank; pass them on."""
    return args, kwargs


def dispatch_dp_compute(wg: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Like ALL_TO_ALL, but check that each argument has one entry per rank."""
    for i, a in enumerate(args):
        _check_per_rank(f"#{i}", a, wg.world_size)
    for k, v in kwargs.items():
        _check_per_rank(k, v, wg.world_size)
    return args, kwargs


def dispatch_rank_zero(wg: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Only rank 0 runs: one-entry lists."""
    return tuple([a] for a in args), {k: [v] for k, v in kwargs.items()}


def collect_all_to_all(wg: Any, outputs: list) -> list:
    """The list of per-rank outputs, in rank order."""
    return outputs


def collect_rank_zero(wg: Any, outputs: list) -> Any:
    """The output of rank 0."""
    return outputs[0]


def _is_tensordict(x: Any) -> bool:
    return isinstance(x, TensorDict)


def _split_tensordict(value: Any, parts: int, pad_size: int) -> list:
    """`parts` equal shards of a TensorDict along dim 0 (it is never padded: its length must divide)."""
    n = value.batch_size[0] if value.batch_dims else 0
    if n % parts or pad_size:
        raise ValueError(
            f"a TensorDict argument of {n} rows must split evenly over {parts} dp ranks "
            f"(and DataProto arguments of the call must need no padding, pad {pad_size}); pad it yourself"
        )
    return list(value.split(n // parts, dim=0))


def _split_value(value: Any, parts: int, pad_size: int, tensordicts: bool = False) -> list:
    """One shard per part for a DataProto / future / ObjectRef (and a TensorDict when `tensordicts`);
    anything else repeated."""
    if tensordicts and _is_tensordict(value):
        return _split_tensordict(value, parts, pad_size)
    if _is_proto(value):
        if pad_size:
            with single_thread():
                value, _ = pad_dataproto_to_divisor(value, parts)
        return value.chunk(parts)
    if _is_future(value):
        return value.chunk(parts)
    if _is_object_ref(value):
        return _future_of_ref(value).chunk(parts)
    return [value] * parts


def _is_object_ref(x: Any) -> bool:
    # a Ray object ref exists only once Ray is imported: the local backend never imports it (nor needs it installed)
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(x, ray.ObjectRef)


def _first(outputs: list) -> Any:
    return outputs[0]


def _future_of_ref(ref: Any) -> Any:
    return DataProtoFuture(collect_fn=_first, futures=[ref])


def _pad_size(values: list, parts: int) -> int:
    """Rows to append so every DataProto argument splits evenly (all must agree in length)."""
    lengths = {len(v) for v in values if _is_proto(v)}
    if len(lengths) > 1:
        raise ValueError(
            f"DataProto arguments of one call must have the same length to be split together, got {sorted(lengths)}"
        )
    if not lengths:
        return 0
    return -lengths.pop() % parts


def split_data_proto(parts: int, args: tuple, kwargs: dict, tensordicts: bool = False) -> tuple[tuple, dict, int]:
    """Split every DataProto-like argument into `parts` shards (padding if needed); `tensordicts`:
    TensorDict arguments too (unpadded, as verl's mesh dispatch does)."""
    pad = _pad_size([*args, *kwargs.values()], parts)
    s_args = tuple(_split_value(a, parts, pad, tensordicts) for a in args)
    s_kwargs = {k: _split_value(v, parts, pad, tensordicts) for k, v in kwargs.items()}
    return s_args, s_kwargs, pad


def dispatch_dp_compute_data_proto(wg: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Split DataProto / DataProtoFuture arguments over the ranks; others go to every rank.

    A DataProto is padded to a multiple of the world size (the padding rows
    are dropped from the collected result). A DataProtoFuture or ObjectRef is
    chunked without being fetched, so its length must divide by the world
    size (the worker resolving a chunk raises otherwise).
    """
    s_args, s_kwargs, pad = split_data_proto(wg.world_size, args, kwargs)
    if pad:
        s_kwargs[PAD_SIZE_KEY] = pad
    return s_args, s_kwargs


def dispatch_dp_compute_data_proto_with_func(wg: Any, func: Callable, *args: Any, **kwargs: Any):
    """First argument is a function sent to every rank; the rest as DP_COMPUTE_PROTO."""
    if not callable(func):
        raise TypeError(f"DP_COMPUTE_PROTO_WITH_FUNC expects a function first, got {type(func).__name__}")
    s_args, s_kwargs = dispatch_dp_compute_data_proto(wg, *args, **kwargs)
    return ([func] * wg.world_size, *s_args), s_kwargs


def collect_dp_compute_data_proto(wg: Any, outputs: list) -> Any:
    """Concatenate the per-rank DataProto outputs in rank order."""

    bad = [type(o).__name__ for o in outputs if not isinstance(o, DataProto)]
    if bad:
        raise TypeError(
            f"a DataProto-collecting dispatch mode got worker outputs of type {bad[0]}; return a "
            "DataProto from the method, or use Dispatch.DP_COMPUTE_METRIC for other results"
        )
    with single_thread():
        return DataProto.concat(outputs)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict:
    """A dispatch mode over the named device mesh the workers declared.

    Each worker declares `(dp_rank, is_collect)` for `mesh_name` with
    `Worker._register_dispatch_collect_info`. The batch is split into as many
    shards as there are dp ranks; every rank of a dp group (all its tp ranks)
    gets that group's shard; the outputs of the collecting ranks (one per dp
    group, e.g. tp rank 0) are concatenated in dp order. A TensorDict argument is split too (its
    length must divide by the dp size) and TensorDict outputs are concatenated, as in verl.
    """

    def dispatch_fn(wg: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        info = wg.get_dispatch_info(mesh_name)
        dp_size = 1 + max(dp for dp, _ in info)
        s_args, s_kwargs, pad = split_data_proto(dp_size, args, kwargs, tensordicts=True)
        r_args = tuple([shards[dp] for dp, _ in info] for shards in s_args)
        r_kwargs = {k: [shards[dp] for dp, _ in info] for k, shards in s_kwargs.items()}
        if pad:
            r_kwargs[PAD_SIZE_KEY] = pad
        return r_args, r_kwargs

    def collect_fn(wg: Any, outputs: list) -> Any:
        info = wg.get_dispatch_info(mesh_name)
        picked = sorted(((dp, out) for (dp, collect), out in zip(info, outputs) if collect), key=lambda t: t[0])
        dps = [dp for dp, _ in picked]
        if dps != sorted({dp for dp, _ in info}):
            raise ValueError(
                f"mesh {mesh_name!r}: collecting ranks cover dp ranks {dps}; exactly one rank per "
                "dp group must be declared is_collect=True"
            )
        outputs = [out for _, out in picked]
        if outputs and all(_is_tensordict(o) for o in outputs):
            with single_thread():
                return torch.cat(outputs, dim=0)
        return collect_dp_compute_data_proto(wg, outputs)

    return {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn, "collects_proto": True}
