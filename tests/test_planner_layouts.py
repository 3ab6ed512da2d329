"""The layout search's profiles (planner/layouts.py, planner/auto.py `cached_device_profiles`): every candidate
layout measured by one set of processes, cached per layout."""

import pytest
import torch

from hybridflow.models import tiny_model_dir
from hybridflow.planner import auto
from hybridflow.planner.auto import ProfileSpec, cached_device_profiles
from hybridflow.planner.device import DeviceProfile
from hybridflow.planner.layouts import DECODE_PROMPT, Layout, profile_layouts


@pytest.mark.slow  # 6 s here: two processes load a tiny model and time it as 1 x 2 threads and 2 x 1
def test_one_set_of_processes_profiles_every_layout():
    one, two = profile_layouts(
        str(tiny_model_dir("llama")),
        [Layout(1, 2, 4), Layout(2, 1, 2, collectives=True)],
        (2, 8),
        torch.float32,
        rounds=2,
    )
    assert [(p.threads, p.batch, p.length, p.decode_batch) for p in one.points + two.points] == [
        (2, 2, 8, 4),
        (1, 2, 8, 2),
    ]
    for prof in (one, two):
        (p,) = prof.points
        assert min(p.forward_s_per_token, p.train_s_per_token, p.decode_s_per_token) > 0 and p.optimizer_s >= 0
        assert p.decode_prompt == DECODE_PROMPT and prof.weight_sync_s_per_byte > 0
    # gloo's collectives priced for the layout that asked: timed between the set's two processes
    assert one.allreduce_latency_s == 0 and two.allreduce_latency_s > 0 and two.allgather_s_per_byte > 0


def test_missing_profiles_are_measured_together_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(auto, "cache_root", lambda: tmp_path)
    calls = []

    def fake_profile_layouts(model, layouts, shape, dtype):
        calls.append((list(layouts), dtype))
        return [DeviceProfile(model, str(dtype), []) for _ in layouts]

    monkeypatch.setattr(auto, "profile_layouts", fake_profile_layouts)
    model = tiny_model_dir("llama")
    specs = [ProfileSpec(2, torch.float32, 8, 1, False), ProfileSpec(1, torch.float32, 8, 2, True)]
    first = cached_device_profiles(model, specs)
    # one set measures both layouts: each worker decodes its rows per thread x threads
    assert calls == [([Layout(1, 2, 16, False), Layout(2, 1, 8, True)], torch.float32)]
    assert len(list((tmp_path / "device_profiles").glob("*.json"))) == 2
    assert cached_device_profiles(model, specs) == first and len(calls) == 1  # read back, nothing measured
    bf16 = ProfileSpec(2, torch.bfloat16, 8, 1, False)
    cached_device_profiles(model, [specs[0], bf16])  # only the missing one, in its own dtype
    assert calls[1] == ([Layout(1, 2, 16, False)], torch.bfloat16)
