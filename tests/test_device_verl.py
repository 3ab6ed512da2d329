"""verl's `verl.utils.device` names in hybridflow.utils.device (this machine: no CUDA, no NPU)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.utils import device


def test_device_name_follows_the_workers_device_variable_else_detection(monkeypatch):
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device.get_device_name() == expected
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    assert device.get_device_name() == "cpu"
    monkeypatch.setenv(device.DEVICE_ENV, "cuda")
    assert device.get_device_name() == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers on a machine without accelerators")
def test_answers_without_an_accelerator(monkeypatch):
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    assert device.is_cuda_available is False and device.is_npu_available is False
    assert device.is_torch_npu_available() is False
    assert device.get_nccl_backend() == "nccl"
    assert device.get_torch_device() is torch.cpu and device.get_device_id() == "cpu"  # verl: getattr(torch, "cpu")
    monkeypatch.setenv(device.DEVICE_ENV, "cuda")  # a GPU worker's process asks for torch.cuda
    assert device.get_torch_device() is torch.cuda
    monkeypatch.delenv(device.DEVICE_ENV)
    assert device.get_resource_name() == "NPU"  # verl's rule: "GPU" only when CUDA is available
    assert device.get_visible_devices_keyword() == "CUDA_VISIBLE_DEVICES"
    device.set_expandable_segments(True)  # a no-op without CUDA


def test_existing_helpers_unchanged():
    assert device.dist_backend("cpu") == "gloo" and device.dist_backend("cuda") == "nccl"
    assert device.cuda_index(3, 1) == 0
