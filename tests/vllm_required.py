"""The vllm test modules' guard: skip where vllm is not installed, fail where it is installed but broken."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

REASON = "needs vllm: ./scripts/setup.sh --vllm, then .venv-vllm/bin/python -m pytest -m vllm"


def require_vllm() -> None:
    """Skip the calling module when no `vllm` package exists; import it otherwise, so that an install that
    cannot be imported is a collection error (red), never a skip (green)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(REASON, allow_module_level=True)
    importlib.import_module("vllm")
