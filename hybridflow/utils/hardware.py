"""What the CPU at hand is and how fast it multiplies, for bench headers and `param_dtype=auto`.

Machines of one "kind" differ: bf16 matmuls ran ~4.5x faster than fp32 on one 2-core
CPU and ~2.4x on another (AMD EPYC, avx512_bf16 without AMX), so every speed figure is
printed next to the CPU that produced it, and the compute dtype can be chosen by a probe.
"""

from __future__ import annotations

import time

import torch


def cpu_model() -> str:
    """The CPU's model name, as lscpu prints it ("unknown" where /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


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
    """One header line: CPU model, bf16 and fp32 2048^3 matmul GFLOP/s on `threads` threads, the threads."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        bf16, fp32 = matmul_gflops(torch.bfloat16), matmul_gflops(torch.float32)
        return (f"cpu: {cpu_model()}; matmul 2048^3 bf16 {bf16:.0f} / fp32 {fp32:.0f} GFLOP/s "
                f"({bf16 / fp32:.1f}x) on {torch.get_num_threads()} threads")
    finally:
        torch.set_num_threads(old)
