"""hybridflow: RL post-training of language models on the HybridFlow programming model.

The top-level names load lazily so that `import hybridflow.algos` (pure tensor
math) never pulls in Ray or the runtime.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DataProto": "hybridflow.protocol",
    "DataProtoFuture": "hybridflow.protocol",
    "register": "hybridflow.controller.decorator",
    "Dispatch": "hybridflow.controller.decorator",
    "Execute": "hybridflow.controller.decorator",
    "Worker": "hybridflow.controller.worker",
    "WorkerGroup": "hybridflow.controller.worker_group",
    "ResourcePool": "hybridflow.controller.resource_pool",
    "ClassWithInitArgs": "hybridflow.controller.resource_pool",
    "RayResourcePool": "hybridflow.controller.ray",
    "RayWorkerGroup": "hybridflow.controller.ray",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
