"""DataProto and its helpers: the batch that flows between the controller and the workers.

- `proto.py`: `DataProto` (tensors, non-tensors, meta_info) and `DataProtoItem`;
- `future.py`: `DataProtoFuture` and the padding that lets any batch split over any number of workers;
- `values.py`: the value helpers behind DataProto (object arrays, the tensor codec, equality, meta merging);
- `verl.py`: verl's free helper functions with verl's signatures;
- `keys.py`: every batch key with its shape and meaning (importable without torch).

The names load lazily, so `from hybridflow.protocol import keys` stays light (no torch).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "DataProto": "hybridflow.protocol.proto",
    "DataProtoItem": "hybridflow.protocol.proto",
    "collate_fn": "hybridflow.protocol.proto",
    "DataProtoFuture": "hybridflow.protocol.future",
    "pad_dataproto_to_divisor": "hybridflow.protocol.future",
    "unpad_dataproto": "hybridflow.protocol.future",
}


def _verl_exports() -> dict[str, str]:
    return {name: "hybridflow.protocol.verl" for name in import_module("hybridflow.protocol.verl").__all__}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    if name == "__all__":
        return sorted({*_EXPORTS, *_verl_exports()})
    verl = _verl_exports()
    if name in verl:
        return getattr(import_module(verl[name]), name)
    raise AttributeError(f"module 'hybridflow.protocol' has no attribute {name!r}")
