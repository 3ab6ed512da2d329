"""utils/peak_memory.py: an operator's peak memory, reset between operators."""

import mmap

from hybridflow.utils.peak_memory import operator_peak


def rss_bytes() -> float:
    with open("/proc/self/status") as f:
        return next(float(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_operator_peak_sees_a_large_temporary_and_resets_after_it():
    metrics: dict[str, float] = {}
    before = rss_bytes()
    with operator_peak("big", metrics):
        # 128 MiB of fresh anonymous pages, touched: an mmap of its own, because a malloc'ed temporary may reuse
        # pages an earlier test left resident (an in-process worker's engine keeps freed memory: mallopt)
        buf = mmap.mmap(-1, 128 * 2**20)
        for offset in range(0, len(buf), mmap.PAGESIZE):
            buf[offset] = 1
        buf.close()
    assert metrics["memory/peak_gb/big"] * 1e9 >= before + 120 * 2**20  # the temporary is in the peak
    with operator_peak("small", metrics):
        pass
    # reset before "small": its peak is what the process holds now, not the lifetime high-water mark
    assert metrics["memory/peak_gb/small"] * 1e9 <= rss_bytes() + 16 * 2**20
    assert metrics["memory/peak_gb/small"] < metrics["memory/peak_gb/big"]
