"""utils/peak_memory.py: an operator's peak memory, reset between operators."""

import torch

from hybridflow.utils.peak_memory import operator_peak, rss_peak_bytes


def test_operator_peak_sees_a_large_temporary_and_resets_after_it():
    metrics: dict[str, float] = {}
    with operator_peak("big", metrics):
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    with operator_peak("small", metrics):
        pass
    assert metrics["memory/peak_gb/big"] * 1e9 >= rss_peak_bytes() - 1e6  # never below what the process holds
    assert metrics["memory/peak_gb/big"] - metrics["memory/peak_gb/small"] > 0.05  # the 64 MiB are gone again
