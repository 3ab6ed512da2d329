"""The decoder's products y = x W^T + b, each in the layout that runs fastest on this CPU.

`F.linear` hands CPU products to MKL (fp32) or oneDNN (bf16), and oneDNN reorders the weight into its blocked
layout on every call. At decode sizes (a few dozen rows) that reorder costs as much as the product, and on the
avx2-only EPYC MKL's fp32 product is itself slow at these shapes (bench/decode_profile.py --compare). A `Linear`
reorders its weight once per generate call (the decoder is built per call) where that pays.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor


class Linear:
    """y = x W^T + b, in the layout that runs fastest here (`_pack_for_onednn`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, rows_hint: int = 64) -> None:
        self.bias = bias
        self.packed = _pack_for_onednn(weight, rows_hint)
        self.weight = weight if self.packed is None else None  # the packed copy replaces it

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


_PACKING_PAYS: dict[tuple[int, int, int], bool] = {}
"""(out, in, rows) -> whether oneDNN's packed fp32 product beat F.linear when this process timed it."""


def _pack_for_onednn(weight: Tensor, rows_hint: int) -> Tensor | None:
    """The weight reordered once into oneDNN's blocked layout, or None where F.linear is the better path.

    bf16: always packed where oneDNN has bf16 (`F.linear` reorders the weight on every call, which at decode
    sizes costs as much as the product; SmolLM2, 64 rows: 1.3-1.8x faster, bit-identical). fp32: packed when a
    timing of this shape says so, once per process (on the avx2-only EPYC, MKL's fp32 product at 8 rows took
    3.7x oneDNN's on the LM head and 1.2-1.4x on the layers' projections; bench/decode_profile.py --compare).
    """
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        if weight.dtype == torch.bfloat16:
            if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return None
        elif weight.dtype != torch.float32 or not _packing_pays(weight, rows_hint):
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    except (AttributeError, RuntimeError):  # private ops: absent or refused in some builds
        return None


def _packing_pays(weight: Tensor, rows: int, trials: int = 3) -> bool:
    """Time F.linear against the packed product on `rows` random rows (best of `trials`, alternating)."""
    key = (*weight.shape, rows)
    if key not in _PACKING_PAYS:
        w = weight.detach()
        x = torch.randn(rows, w.shape[1], dtype=w.dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        calls = (lambda: F.linear(x, w), lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        best = [float("inf"), float("inf")]
        with torch.no_grad():
            for _ in range(trials + 1):  # the first round warms both up
                for i, call in enumerate(calls):
                    start = time.perf_counter()
                    call()
                    best[i] = min(best[i], time.perf_counter() - start)
        _PACKING_PAYS[key] = best[1] < best[0]
    return _PACKING_PAYS[key]
