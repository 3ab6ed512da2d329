"""What the CPU at hand is and how fast it multiplies, for bench headers and `param_dtype=auto`.

Machines of one "kind" differ: bf16 matmuls ran ~4.5x faster than fp32 on one 2-core
CPU and ~2.4x on another (AMD EPYC, avx512_bf16 without AMX), so every speed figure is
printed next to the CPU that produced it, and the compute dtype can be chosen by a probe.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path

import torch

from hybridflow.utils.atomic import atomic_file
from hybridflow.utils.cache import cache_root

log = logging.getLogger(__name__)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_signature() -> str:
    """What decides this CPU's kernel speeds, for keying measured caches: the model name, family and model
    (machines that all say "AMD EPYC" differ), the vector ISA torch dispatches to (ATEN_CPU_CAPABILITY caps it),
    the bf16/AMX flags oneDNN uses, and a oneDNN ISA cap when ONEDNN_MAX_CPU_ISA sets one."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    traits = [
        f"family {info.get('cpu family', '?')} model {info.get('model', '?')}",
        torch.backends.cpu.get_cpu_capability(),
        *(f for f in ("avx512_bf16", "amx_bf16") if f in flags),
    ]
    if isa_cap := os.environ.get("ONEDNN_MAX_CPU_ISA"):
        traits.append(f"oneDNN <= {isa_cap}")
    return f"{info.get('model name', 'unknown')} ({', '.join(traits)})"


def matmul_gflops(dtype: torch.dtype, shape: tuple[int, int, int] = (2048, 2048, 2048), repeats: int = 5) -> float:
    """Best-of-`repeats` GFLOP/s of an (m x k) @ (k x n) matmul in `dtype` on the current threads."""
    m, k, n = shape
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b  # first call: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def describe_cpu(threads: int | None = None) -> str:
    """One header line: the CPU (`cpu_signature`: the three EPYC types differ there, not in the model name), bf16
    and fp32 2048^3 matmul GFLOP/s on `threads` threads, the threads.

    bf16 is first timed on 512^3; below `SLOW_BF16_GFLOPS` that figure is reported (marked 512^3), since
    six 2048^3 bf16 matmuls take minutes on CPUs without bf16 instructions (0.3-1 GFLOP/s).
    """
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        bf16, bf16_shape = matmul_gflops(torch.bfloat16, (512, 512, 512), repeats=1), " (512^3)"
        if bf16 >= SLOW_BF16_GFLOPS:
            bf16, bf16_shape = matmul_gflops(torch.bfloat16), ""
        fp32 = matmul_gflops(torch.float32)
        return (
            f"cpu: {cpu_signature()}; matmul 2048^3 bf16 {bf16:.0f}{bf16_shape} / fp32 {fp32:.0f} GFLOP/s "
            f"({bf16 / fp32:.1f}x) on {torch.get_num_threads()} threads"
        )
    finally:
        torch.set_num_threads(old)


SLOW_BF16_GFLOPS = 20.0
"""bf16 GFLOP/s on 512^3 under which `describe_cpu` does not time the 2048^3 bf16 matmul."""


BF16_MIN_SPEEDUP = 1.5
"""`auto` picks bf16 where its matmuls run at least this many times fp32's: below that, the casts
around every layer and the coarser gradients are not paid back."""


def probe_compute_dtype(threads: int) -> dict[str, float | str]:
    """Time a 1024^3 matmul in bf16 and fp32 on `threads` threads; {"bf16": GFLOP/s, "fp32": ..., "choice": ...}.

    bf16 is first timed on 256^3: below `SLOW_BF16_GFLOPS` that figure stands (fp32 wins by far), since four
    1024^3 bf16 matmuls take ~20 s on CPUs without bf16 instructions.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bf16 = matmul_gflops(torch.bfloat16, (256, 256, 256), repeats=1)
        if bf16 >= SLOW_BF16_GFLOPS:
            bf16 = matmul_gflops(torch.bfloat16, (1024, 1024, 1024), repeats=3)
        fp32 = matmul_gflops(torch.float32, (1024, 1024, 1024), repeats=3)
    finally:
        torch.set_num_threads(old)
    return {
        "bf16": round(bf16, 1),
        "fp32": round(fp32, 1),
        "choice": "bf16" if bf16 >= BF16_MIN_SPEEDUP * fp32 else "fp32",
    }


def _probe_cache() -> Path:
    return cache_root() / "dtype_probe.json"


@functools.cache
def auto_compute_dtype(device: str = "cpu", threads: int | None = None) -> str:
    """The compute dtype "auto" stands for: bf16 on a CUDA GPU that supports it; on CPU, the measured
    choice of `probe_compute_dtype`, probed once per machine (`cpu_signature`, threads, torch version) and
    kept in dtype_probe.json under `cache_root()` ($HYBRIDFLOW_CACHE, else ~/.cache/hybridflow). Logged once per
    process."""
    if device == "cuda":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    threads = threads or torch.get_num_threads()
    key = f"{cpu_signature()} | {threads} threads | torch {torch.__version__}"
    path = _probe_cache()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = probe_compute_dtype(threads)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as f:
                f.write(json.dumps(cache, indent=1))
        except OSError:
            pass  # a read-only home only costs a probe per process
    p = cache[key]
    log.info(
        "compute dtype auto -> %s: matmul 1024^3 bf16 %.0f vs fp32 %.0f GFLOP/s on %s (%s)",
        p["choice"],
        p["bf16"],
        p["fp32"],
        key,
        path,
    )
    return str(p["choice"])
