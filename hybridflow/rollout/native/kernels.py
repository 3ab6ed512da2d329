"""The element-wise parts of a decoder layer, eager or compiled with torch.compile (inductor).

At decode sizes on CPU (a few dozen rows) each eager tensor op costs tens of microseconds of
dispatch and memory traffic whatever its size, and a Llama-style layer runs ~20 of them around its
four projections: RMSNorm alone is 4-5 ops with fp32 up- and down-casts. Compiled, each group
below becomes one fused C++ loop. The projections and attention stay on oneDNN / SDPA either way.

`decoder_kernels(compile=True)` returns the compiled set, which falls back to the eager one (with a
warning, once per process) if inductor cannot build (no C++ compiler, an unsupported platform). The
shapes are marked dynamic, so prefill, decode and every batch size share one compilation; inductor
caches the built code on disk, so later processes start faster than the first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


def swap_halves(x: Tensor) -> Tensor:
    """(x1, x2) -> (x2, x1) on the last dim; with a sign-flipped sin table this is rotate_half."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (fp32 statistics, as F.rms_norm)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual update and the next norm in one pass: (h + delta, rms_norm(h + delta))."""
    h = h + delta
    return h, F.rms_norm(h, weight.shape, weight, eps)


def rotary(qk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of the stacked q and k heads [B, S, H, D] (sin carries rotate_half's sign)."""
    return qk * cos + swap_halves(qk) * sin


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's element-wise half: silu(gate) * up from the fused [.., 2I] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class DecoderKernels:
    """One implementation of each element-wise group a decoder layer runs."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    rotary: Callable[[Tensor, Tensor, Tensor], Tensor]
    silu_mul: Callable[[Tensor], Tensor]
    compiled: bool
    """Whether these are the torch.compile versions."""


EAGER = DecoderKernels(rms_norm, add_rms_norm, rotary, silu_mul, compiled=False)
_compiled: DecoderKernels | None = None


def decoder_kernels(compile: bool) -> DecoderKernels:
    """The eager kernels, or (compile=True) the compiled ones: built once per process, eager on failure."""
    global _compiled
    if not compile:
        return EAGER
    if _compiled is None:
        _compiled = _build_compiled()
    return _compiled


def _build_compiled() -> DecoderKernels:
    compiled = DecoderKernels(
        **{
            name: torch.compile(getattr(EAGER, name), dynamic=True, fullgraph=True)
            for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul")
        },
        compiled=True,
    )
    start = time.perf_counter()
    try:
        _warm_up(compiled)
    except Exception as err:  # inductor needs a working C++ toolchain; any failure means: run eagerly
        log.warning(
            "torch.compile of the decoder kernels failed (%s: %s); decoding eagerly",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return EAGER
    log.info("compiled the decoder kernels in %.1f s", time.perf_counter() - start)
    return compiled


def _warm_up(k: DecoderKernels) -> None:
    """Compile every kernel for bf16 and fp32 now, so that a failure shows here and not mid-generation.

    Two batch sizes each, so the first trace is already the dynamic one (no later recompile per shape)."""
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (2, 3):
            x, w = torch.randn(rows, 1, 8, dtype=dtype), torch.ones(8, dtype=dtype)
            k.rms_norm(x, w, 1e-6)
            k.add_rms_norm(x, x, w, 1e-6)
            k.rotary(
                torch.randn(rows, 1, 3, 4, dtype=dtype),
                torch.ones(rows, 1, 1, 4, dtype=dtype),
                torch.ones(rows, 1, 1, 4, dtype=dtype),
            )
            k.silu_mul(x)
