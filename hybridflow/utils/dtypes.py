"""The dtype names a config accepts ("fp32", "bf16", and "auto" for compute dtypes), defined once for
every section that takes one. "auto" is the dtype a matmul probe measured to pay on this machine
(hybridflow/utils/hardware.py `auto_compute_dtype`); the resolve stage fills it in for a run."""

from __future__ import annotations

import torch

from hybridflow.utils.device import device_kind
from hybridflow.utils.hardware import auto_compute_dtype

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Config dtype name -> torch dtype. fp16 is left out on purpose: CPU fp16 matmul is ~100x slower."""


AUTO = "auto"


def dtype_of(name: str) -> torch.dtype:
    """torch dtype for a config dtype name ("fp32" | "bf16" | "auto": probed for this process's device kind and
    threads)."""
    if name == AUTO:
        name = auto_compute_dtype(device_kind())
    return DTYPES[name]


def check_dtype(key: str, value: str, allow_auto: bool = True) -> None:
    """Raise ValueError naming `key` when `value` is not a dtype name (nor "auto", where allowed)."""
    names = sorted(DTYPES) + [AUTO] * allow_auto
    if value not in names:
        raise ValueError(f"{key} must be one of {names}, got {value!r}")


def resolve_dtype(name: str, device: str, threads: int) -> str:
    """`name`, with "auto" replaced by the measured choice for `device` with `threads` threads per worker."""
    if name != AUTO:
        return name

    return auto_compute_dtype(device, threads)
