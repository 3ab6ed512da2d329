"""Which device a process computes on: decided by the run's `trainer.device`, never by what torch can see.

A worker group tells each worker its device kind through `DEVICE_ENV` (set from its resource pool's
`use_gpu`, which `trainer.device` decides); code that runs outside a worker (tests, benches,
`hybridflow export`) computes on the CPU unless that variable says otherwise.

A GPU worker uses the device Ray gave it: Ray narrows each GPU actor's CUDA_VISIBLE_DEVICES to its
own GPU, so that GPU is index 0 in the process whatever its LOCAL_RANK; a launcher that shows every
GPU of the node to every process (torchrun) leaves LOCAL_RANK as the index (`cuda_index`).

This module imports nothing from hybridflow, so any layer may use it.
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "HYBRIDFLOW_DEVICE"
"""Environment variable holding this process's device kind: "cpu" (default) or "cuda"."""
DEVICE_KINDS = ("cpu", "cuda")


def device_kind() -> str:
    """This process's device kind, from `DEVICE_ENV` ("cpu" when unset)."""
    kind = os.environ.get(DEVICE_ENV, "cpu")
    if kind not in DEVICE_KINDS:
        raise ValueError(f"{DEVICE_ENV}={kind!r} must be one of {', '.join(DEVICE_KINDS)}")
    return kind


def dist_backend(kind: str) -> str:
    """The torch.distributed backend for a device kind: nccl on cuda, gloo on cpu."""
    return "nccl" if kind == "cuda" else "gloo"


def cuda_index(local_rank: int, visible: int) -> int:
    """The CUDA index of this process's GPU among the `visible` ones (torch.cuda.device_count()).

    One visible GPU (Ray's per-actor CUDA_VISIBLE_DEVICES, or a single-GPU machine) is index 0; with
    several visible, the process's `local_rank` among its node's workers picks one.
    """
    if visible < 1:
        raise ValueError(
            f"{DEVICE_ENV}=cuda but no CUDA device is visible to this process; "
            "give the workers GPUs (trainer.device=cuda on a GPU node) or use trainer.device=cpu"
        )
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {visible} CUDA devices are visible to this process; "
            "start at most one worker per visible GPU on each node"
        )
    return local_rank


def compute_device(kind: str | None = None) -> torch.device:
    """The device this process computes on (`kind` None: `device_kind()`); on cuda it becomes torch's current one."""
    kind = kind or device_kind()
    if kind == "cpu":
        return torch.device("cpu")
    index = cuda_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
