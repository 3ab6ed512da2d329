"""The decoder's products y = x W^T + b, each in the layout that runs fastest on this CPU.

`F.linear` hands CPU products to MKL (fp32) or oneDNN (bf16), and oneDNN reorders the weight into its blocked
layout on every call. At decode sizes (a few dozen rows) that reorder costs as much as the product, and on the
avx2-only EPYC MKL's fp32 product is itself slow at these shapes (bench/decode_profile.py --compare). A `Linear`
lays its weight out once per generate call (the decoder is built per call) in one of these ways:
- "plain": the module's own tensor, through `F.linear`;
- "packed": reordered once into oneDNN's blocked layout;
- "panels": fp32 in 16-column panels for hybridflow's AVX2 / AVX-512 kernel (rollout/native/panel.py);
- "bf16_panels": the weight in bf16 in those panels, fp32 math: an fp32 weight rounded (rollout.weight_dtype=bf16)
  or a bf16 model's own weight (a few rows of a bf16 rollout, rollout/native/rollout.py);
- "bf16_dot": a bf16 model's own weight in panels of column pairs, bf16 products with fp32 sums (AVX512-BF16 CPUs).
Where bf16 panels are asked for and the kernel runs they are used (a bf16 weight's "bf16_dot" where its kernel was
built); otherwise bf16 is packed wherever oneDNN has bf16, and fp32 takes whichever a timing of the shape in this
process finds fastest (once per shape and process).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridflow.rollout.native import panel

_PANEL_DTYPE = {"panels": torch.float32, "bf16_panels": torch.bfloat16, "bf16_dot": torch.bfloat16}


class Linear:
    """y = x W^T + b, in the layout `path` names (None: `_choose`'s pick for `rows_hint` rows and
    `weight_dtype`, the rollout's rollout.weight_dtype). `weight` is one tensor or a list of row blocks stacked in
    order (fused q/k/v, gate/up): the panel layouts take the blocks one by one, the others their stack."""

    def __init__(
        self,
        weight: Tensor | list[Tensor],
        bias: Tensor | None,
        rows_hint: int = 64,
        path: str | None = None,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        blocks = weight if isinstance(weight, list) else [weight]
        first = blocks[0]
        shape = (sum(b.shape[0] for b in blocks), first.shape[1])
        self.path = path or _choose(first if len(blocks) == 1 else first.new_empty(shape), rows_hint, weight_dtype)
        dtype = _PANEL_DTYPE.get(self.path)
        # the panel kernel adds an fp32 bias (a bf16 model's bias is widened: exact)
        self.bias = bias.detach().float() if dtype is not None and bias is not None else bias
        dot = self.path == "bf16_dot"
        self.panels = None if dtype is None else panel.to_panels(*blocks, dtype=dtype, pairs=dot)
        self.kernel = panel.kernel(panel.DOT) if dot else None  # None: the panels' dtype's kernel
        stack = None if dtype is not None else first if len(blocks) == 1 else torch.cat(blocks)
        self.packed = _reorder(stack, rows_hint) if self.path == "packed" else None
        self.weight = stack if self.path == "plain" else None  # a packed or panel copy replaces it

    def __call__(self, x: Tensor) -> Tensor:
        if self.panels is not None:
            return panel.panel_linear(x, self.panels, self.bias, self.kernel)
        # x.to: fp32 activations of a bf16 model on panels elsewhere (e.g. a vocabulary not in whole panels)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.to(self.packed.dtype), self.packed, self.bias, "none", [], "")
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def compute_dtype(dtype: torch.dtype, weight_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a decoder of weights in `dtype` computes in: fp32 where its products run on bf16 panels
    (`weight_dtype` bf16 and the panel kernel built here), else `dtype`."""
    return torch.float32 if weight_dtype == torch.bfloat16 and panel.kernel() is not None else dtype


_FASTEST: dict[tuple[int | str, ...], str] = {}
"""(out, in, rows, *usable paths) -> the fp32 path that was fastest when this process timed it."""


def _choose(weight: Tensor, rows: int, weight_dtype: torch.dtype | None = None) -> str:
    """`weight_dtype` bf16: "bf16_dot" for a bf16 weight where that kernel was built, else "bf16_panels" where
    the panel kernel runs. bf16 otherwise: "packed" where oneDNN has
    bf16 (SmolLM2, 64 rows: 1.3-1.8x F.linear, bit-identical). fp32 otherwise: the fastest available path
    on `rows` random rows (on the avx2-only EPYC, MKL's fp32 product at 8 rows took 3.7x oneDNN's on the LM
    head; bench/decode_weights.py compares them)."""
    if weight_dtype == torch.bfloat16 and panel.fits(weight, pairs=True) and panel.kernel(panel.DOT) is not None:
        return "bf16_dot"
    if weight_dtype == torch.bfloat16 and panel.fits(weight, torch.bfloat16) and panel.kernel() is not None:
        return "bf16_panels"
    usable = _usable_paths(weight)
    if weight.dtype != torch.float32 or len(usable) == 1:
        return usable[-1]
    key = (*weight.shape, rows, *usable)  # a path that cannot run now (no kernel) is never the cached answer
    if key not in _FASTEST:
        _FASTEST[key] = _time_paths(weight, rows, usable)
    return _FASTEST[key]


def _usable_paths(weight: Tensor) -> list[str]:
    """The paths that can run this weight here, "plain" first."""
    paths = ["plain"]
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return paths
    if _onednn_packs(weight.dtype):
        paths.append("packed")
    if panel.fits(weight) and panel.kernel() is not None:
        paths.append("panels")
    return paths


def _onednn_packs(dtype: torch.dtype) -> bool:
    try:
        if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            return False
        return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # private ops: absent or refused in some builds
        return False


def _reorder(weight: Tensor, rows: int) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def _time_paths(weight: Tensor, rows: int, paths: list[str], trials: int = 3) -> str:
    """The path with the best time of `trials` rounds (after one warm-up round), called in turn."""
    w = torch.randn(weight.shape, dtype=weight.dtype)  # timed on its own values: `weight` may be a shape only
    x = torch.randn(rows, w.shape[1], dtype=w.dtype)
    calls: list[Callable[[], Tensor]] = [Linear(w, None, rows, path).__call__ for path in paths]
    best = [float("inf")] * len(paths)
    with torch.no_grad():
        for _ in range(trials + 1):
            for i, call in enumerate(calls):
                start = time.perf_counter()
                call(x)
                best[i] = min(best[i], time.perf_counter() - start)
    return paths[best.index(min(best))]
