"""The compute device comes from the run's trainer.device (through the worker group), never from what torch sees."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.trainer import TrainerConfig
from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.train.roles import group_factory
from hybridflow.utils.device import DEVICE_ENV, compute_device, cuda_index, device_kind, dist_backend
from tests.controller_workers import Gate


@pytest.mark.parametrize("local_rank", [0, 1, 3, 7])
def test_one_visible_gpu_is_index_0_whatever_the_local_rank(local_rank):
    # Ray narrows CUDA_VISIBLE_DEVICES to the actor's own GPU: rank 3 of a node sees one GPU, index 0.
    assert cuda_index(local_rank, visible=1) == 0


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_every_gpu_visible_picks_the_local_rank(local_rank):
    # torchrun-style: all 4 GPUs of the node visible to every process.
    assert cuda_index(local_rank, visible=4) == local_rank


def test_more_workers_than_visible_gpus_is_refused():
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but only 2 CUDA devices"):
        cuda_index(2, visible=2)


def test_cuda_worker_without_a_visible_gpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="no CUDA device is visible.*trainer.device=cpu"):
        cuda_index(0, visible=0)


def test_kind_defaults_to_cpu_and_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert device_kind() == "cpu" and compute_device() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match=f"{DEVICE_ENV}='tpu'"):
        device_kind()


def test_backend_follows_the_kind():
    assert dist_backend("cpu") == "gloo" and dist_backend("cuda") == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_kind_on_a_machine_without_gpus_fails_clearly(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        compute_device()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_local_group_tells_its_worker_the_run_device(monkeypatch, device):
    monkeypatch.setenv(DEVICE_ENV, "cpu")  # the local worker is this process: its value is restored after the test
    group = LocalWorkerGroup(LocalResourcePool(use_gpu=device == "cuda"), ClassWithInitArgs(Gate))
    assert group.getenv(DEVICE_ENV) == [device]


def test_ray_group_tells_every_worker_the_run_device(ray_local):
    make_group, pools, release = group_factory(TrainerConfig(n_workers_per_node=2, cpus_per_worker=1), [2], "dev")
    group = make_group(pools[0], ClassWithInitArgs(Gate))
    try:
        assert group.getenv(DEVICE_ENV) == ["cpu", "cpu"]
    finally:
        group.shutdown()
        release()
