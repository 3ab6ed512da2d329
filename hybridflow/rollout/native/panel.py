"""fp32 products on weights laid out in 16-column panels (fp32, or bf16 widened as loaded), by a small AVX2 or
AVX-512 kernel (panel.c, built on first use with the decode step that runs them, decode_step.c).

At a decode step's few rows a product's cost is mostly reading its weights, and with AVX2 kernels oneDNN's
product on its blocked layout read them at 13-15 GB/s where a plain read of the same weights ran at 26-41 GB/s
(bench/decode_weights.py, AMD EPYC). `panel.c` reads each thread's run of panels front to back with a prefetch.
The kernel is compiled once per machine with the C compiler (`$CC`, else `cc`) into hybridflow's cache
(`$HYBRIDFLOW_CACHE/kernels`) and loaded with ctypes; where there is no compiler, no AVX2 and FMA, or the build
fails, `kernel()` is None (with one warning) and the decoder keeps torch's products. Where torch's CPU capability is
AVX512 (`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY=avx2` caps) the products are built
with AVX-512, one 16-float vector per panel: a sweep over SmolLM2's 30 layers ran 1.2x / 1.45x / 1.46x faster than
the AVX2 build at 8 / 32 / 64 rows on an Intel Xeon (`bench/decode_weights.py`, BENCHMARKS.md). Where the CPU
also has avx512_bf16 the library adds bf16 products with fp32 sums on bf16 panels of column pairs (`DOT`, for a
bf16 model's own weights): one instruction per two k-steps of a panel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from hybridflow.utils.cache import cache_root

log = logging.getLogger(__name__)

PANEL = 16
"""Output columns per panel: the kernel's two 8-float vectors."""
SOURCES = [Path(__file__).with_name(name) for name in ("panel.c", "decode_step.c")]
"""Compiled together into one library: the products, and the decode step that runs them (rollout/native/fused_step.py)."""
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
AVX512_FLAGS = ["-mavx512f"]
"""Added where torch runs its own kernels with AVX-512: panel.c then compiles its AVX-512 products."""
BF16_FLAGS = ["-mavx512bf16"]
"""Added to those where the CPU lists avx512_bf16: panel.c then compiles `DOT`'s kernel."""

_SYMBOLS = {torch.float32: "hf_panel_linear", torch.bfloat16: "hf_panel_linear_bf16"}
"""What the panels can hold, and each one's kernel; the math is fp32 either way."""
_REPACK = "hf_to_panels"
"""The fp32 layout change as a transpose of 8 x 8 tiles: SmolLM2's 538 MB of weights in 68-71 ms where torch's
strided copy took 92-99 ms (`bench/decode_weights.py --repack`, AVX2 cap, 2 threads, BENCHMARKS.md). It moves 32-bit
words, so it lays out bf16 panels of column pairs too (a pair is one word)."""

DECODE_STEP = "hf_decode_step"
"""A whole decode step through the layers (decode_step.c)."""
DOT = "hf_panel_linear_dot"
"""bf16 products with fp32 sums on `to_panels(..., pairs=True)` (AVX512-BF16 builds only)."""

_UNSET = object()
_kernels: object = _UNSET


def kernel(dtype: torch.dtype | str = torch.float32) -> ctypes._CFuncPtr | None:
    """The built kernel for panels of `dtype` (or `_REPACK`, `DECODE_STEP`, `DOT`), or None where it cannot run
    here; built once per process."""
    global _kernels
    if _kernels is _UNSET:
        _kernels = _load()
    return None if _kernels is None else _kernels.get(dtype)  # type: ignore[union-attr]


def _cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists on an x86-64 CPU (empty elsewhere)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(flags.split()[2:])


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


def _load(build_flags: list[str] | None = None) -> dict[torch.dtype | str, ctypes._CFuncPtr] | None:
    """The library's functions, built with `build_flags` (default: `flags()`), or None where it cannot run here."""
    if not _cpu_has_avx2_fma():
        return None
    build_flags = flags() if build_flags is None else build_flags
    try:
        lib = ctypes.CDLL(str(_build(build_flags)))
    except (OSError, subprocess.SubprocessError) as err:
        if set(BF16_FLAGS) <= set(build_flags):  # a compiler without AVX512-BF16: the rest still runs
            log.warning("the panel kernel's bf16 products did not build (%s); building it without them", err)
            return _load([f for f in build_flags if f not in BF16_FLAGS])
        log.warning("the panel kernel is not available (%s); the rollout uses torch's products", err)
        return None
    p, n, i, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    kernels: dict[torch.dtype | str, ctypes._CFuncPtr] = {}
    for key, symbol, args in [
        *((dtype, symbol, [p, n, p, p, n, n, p, i]) for dtype, symbol in _SYMBOLS.items()),
        (_REPACK, _REPACK, [p, n, n, n, p, i]),
        (DECODE_STEP, DECODE_STEP, [p, n, i, p, p, n, n, n, n, n, n, p, p, n, n, p, p, p, p, p, p, p, f, f, p, i]),
        (DOT, DOT, [p, n, p, p, n, n, p, i]),
    ]:
        if not hasattr(lib, symbol):  # DOT: only in AVX512-BF16 builds
            continue
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = args, None
        kernels[key] = fn
    return kernels


def flags() -> list[str]:
    """The compiler flags for this CPU: AVX2 + FMA, AVX-512 where torch's CPU capability is AVX512, and
    AVX512-BF16 where the CPU lists avx512_bf16 as well."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return FLAGS
    return FLAGS + AVX512_FLAGS + BF16_FLAGS * ("avx512_bf16" in _cpu_flags())


def _build(build_flags: list[str]) -> Path:
    """The shared library for this source and these flags: from the cache, else compiled into it atomically."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH (set CC)")
    sources = b"".join(path.read_bytes() for path in SOURCES)
    digest = hashlib.sha256(sources + " ".join([compiler, *build_flags]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"panel-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        proc = subprocess.run(
            [compiler, *build_flags, "-o", str(built), *map(str, SOURCES)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise OSError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(built, out)
    return out


def fits(weight: Tensor, panel_dtype: torch.dtype = torch.float32, pairs: bool = False) -> bool:
    """Whether a weight [out, in] can go into panels of `panel_dtype` for the kernel: on the CPU, `out` a multiple
    of PANEL, and fp32 (either panels) or bf16 (bf16 panels: the same numbers); `pairs` (`DOT`'s bf16 panels of
    column pairs): a bf16 weight with `in` even."""
    if pairs:
        return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and fits(weight, torch.bfloat16)
    sources = (torch.float32, torch.bfloat16) if panel_dtype == torch.bfloat16 else (torch.float32,)
    return weight.dtype in sources and weight.device.type == "cpu" and weight.shape[0] % PANEL == 0


def to_panels(*parts: Tensor, dtype: torch.dtype = torch.float32, pairs: bool = False) -> Tensor:
    """The row blocks `parts` ([out_i, in] each, stacked in order) as [sum(out_i) / PANEL, in, PANEL] of `dtype`:
    one copy, written block by block where each block is whole panels (fused q/k/v or gate/up never materialise
    their stack first), else from their stack. `pairs`: each panel holds its columns' k and k + 1 side by side
    ([in / 2, PANEL, 2] in the same bytes), the layout `DOT` multiplies."""
    if any(p.shape[0] % PANEL for p in parts):
        parts = (torch.cat(parts),)
    k = parts[0].shape[1]
    out = torch.empty(sum(p.shape[0] for p in parts) // PANEL, k, PANEL, dtype=dtype)
    start = 0
    for p in parts:
        n = p.shape[0] // PANEL
        _write_panels(p.detach(), out[start : start + n], pairs)
        start += n
    return out


def _write_panels(weight: Tensor, out: Tensor, pairs: bool = False) -> None:
    """out [n, in, PANEL] = weight [n * PANEL, in] in panels (of column pairs: `to_panels`): by the kernel's tiled
    transpose of 32-bit words where it runs on this weight (fp32, or bf16 pairs of columns: one word each; rows
    contiguous, a multiple of 8 words), else by torch's strided copy."""
    n, k = out.shape[0], weight.shape[1]
    if pairs and not out.dtype == weight.dtype == torch.bfloat16:
        raise TypeError(f"panels of column pairs hold a bf16 weight, got {weight.dtype} into {out.dtype}")
    per_word = 2 if pairs else 1
    repack = kernel(_REPACK) if pairs or out.dtype == weight.dtype == torch.float32 else None
    # rows may be strided (a tp column chunk of the weight), columns must be contiguous
    if repack is None or weight.stride(1) != 1 or (k // per_word) % 8 or weight.stride(0) % per_word:
        if pairs:
            out.view(n, k // 2, PANEL, 2).copy_(weight.reshape(n, PANEL, k // 2, 2).transpose(1, 2))
        else:
            out.copy_(weight.reshape(n, PANEL, k).transpose(1, 2))
        return
    words, stride = k // per_word, weight.stride(0) // per_word
    repack(weight.data_ptr(), weight.shape[0], words, stride, out.data_ptr(), torch.get_num_threads())


def panel_linear(x: Tensor, panels: Tensor, bias: Tensor | None, fn: ctypes._CFuncPtr | None = None) -> Tensor:
    """x [..., in] (fp32) W^T + b in fp32 with W given as `to_panels(W)` (fp32 or bf16 panels); `fn`: another
    build's kernel for these panels (`_load(FLAGS)[dtype]`: the AVX2 one), by default this CPU's."""
    fn = fn or kernel(panels.dtype)
    if x.dtype != torch.float32:
        raise TypeError(f"the panel kernel multiplies fp32 inputs, got {x.dtype}")
    if fn is None:
        raise RuntimeError("the panel kernel is not available here (panel.kernel() is None)")
    k = panels.shape[1]
    rows = x.reshape(-1, k).contiguous()
    n = panels.shape[0] * PANEL
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    b = None if bias is None else bias.detach().contiguous()
    fn(
        rows.data_ptr(),
        rows.shape[0],
        panels.data_ptr(),
        None if b is None else b.data_ptr(),
        n,
        k,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y.view(*x.shape[:-1], n)
