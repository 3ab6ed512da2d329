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


def ensure_process_group() -> None:
    """Initialise torch.distributed if needed (nccl for a cuda worker, gloo for a cpu one): from env://
    when RANK/WORLD_SIZE are set, else world 1."""
    import torch.distributed as dist  # noqa: PLC0415  (lazy: most importers only ask which device)

    if dist.is_initialized():
        return
    backend = dist_backend(device_kind())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


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


# --- verl's `verl.utils.device` names ------------------------------------------------------------------
# verl programs ask these which accelerator to use; hybridflow has no NPU backend, so the NPU branches only
# report what torch offers. `get_device_name` follows DEVICE_ENV where it is set (every worker), so a CPU
# worker on a GPU machine answers "cpu"; elsewhere it detects like verl.


def is_torch_npu_available(check_device: bool = True) -> bool:
    """Whether torch has Ascend NPU support (`check_device`: and an NPU is usable)."""
    npu = getattr(torch, "npu", None)
    if npu is None:
        return False
    return bool(npu.is_available()) if check_device else True


is_cuda_available: bool = torch.cuda.is_available()
"""Whether torch sees a CUDA device (evaluated at import, as in verl)."""
is_npu_available: bool = is_torch_npu_available()
"""Whether torch sees an Ascend NPU (evaluated at import, as in verl)."""


def get_device_name() -> str:
    """ "cuda", "npu" or "cpu": DEVICE_ENV when set (a worker's device), else the accelerator torch sees."""
    if os.environ.get(DEVICE_ENV):
        return device_kind()
    if is_cuda_available:
        return "cuda"
    return "npu" if is_npu_available else "cpu"


def get_torch_device() -> object:
    """torch's module named by `get_device_name()` (`torch.cuda`, `torch.npu`, `torch.cpu`), as in verl;
    `torch.cuda` when torch has no module of that name."""
    return getattr(torch, get_device_name(), torch.cuda)


def get_device_id() -> int | str:
    """`get_torch_device().current_device()`: the current accelerator's index ("cpu" on the CPU, as torch.cpu
    answers)."""
    return get_torch_device().current_device()


def get_nccl_backend() -> str:
    """The collective backend verl uses for accelerators: "hccl" on an NPU machine, else "nccl"
    (for the backend that fits this process's device, CPU included, use `dist_backend(device_kind())`)."""
    return "hccl" if is_npu_available else "nccl"


def get_resource_name() -> str:
    """Ray's resource name of the accelerator: "GPU" when CUDA is available, else "NPU"."""
    return "GPU" if is_cuda_available else "NPU"


def get_visible_devices_keyword() -> str:
    """The environment variable that narrows the visible accelerators."""
    return "ASCEND_RT_VISIBLE_DEVICES" if is_torch_npu_available(check_device=False) else "CUDA_VISIBLE_DEVICES"


def set_expandable_segments(enable: bool) -> None:
    """Turn the CUDA caching allocator's expandable segments on or off (no-op without CUDA)."""
    if is_cuda_available:
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enable}")
