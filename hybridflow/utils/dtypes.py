"""The dtype names a config accepts ("fp32", "bf16"), defined once for every section that takes one."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Config dtype name -> torch dtype. fp16 is left out on purpose: CPU fp16 matmul is ~100x slower."""


def dtype_of(name: str) -> torch.dtype:
    """torch dtype for a config dtype name ("fp32" | "bf16")."""
    return DTYPES[name]


def check_dtype(key: str, value: str) -> None:
    """Raise ValueError naming `key` when `value` is not a dtype name."""
    if value not in DTYPES:
        raise ValueError(f"{key} must be one of {sorted(DTYPES)}, got {value!r}")
