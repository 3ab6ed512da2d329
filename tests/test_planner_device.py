"""The device profile's measurements (planner/device.py, planner/measure.py): the update split into
micro-batches and the optimizer step, and a node's workers measured side by side, each cost the slowest
worker's."""

import pytest
import torch

from hybridflow.planner import device
from hybridflow.planner.device import DevicePoint, measure_point, slowest


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeOps:
    """Operators that advance a fake clock: forward 1 ms a token, forward + backward 3 ms a token and a 0.5 s
    optimizer step (timed apart, as EngineOperators does); generate 0.1 s of prefill and 2 ms per row per
    decode step."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.optimizer_s = clock, []

    def batch(self, rows, length):
        return rows * length

    def log_probs(self, tokens):
        return lambda: self.clock.advance(1e-3 * tokens)

    def update(self, tokens):
        def run():
            self.clock.advance(3e-3 * tokens + 0.5)
            self.optimizer_s.append(0.5)

        return run

    def generate(self, rows, length, new_tokens):
        return lambda: self.clock.advance(0.1 + 2e-3 * rows * (new_tokens - 1))


def test_measure_point_takes_the_optimizer_step_out_of_the_update(monkeypatch):
    clock, syncs = FakeClock(), []
    monkeypatch.setattr(device.time, "perf_counter", lambda: clock.now)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave this process's threads alone
    ops = FakeOps(clock)
    ops.optimizer_s.append(9.0)  # a step of an earlier point: not this one's
    p = measure_point(ops, 1, 4, 16, repeats=1, decode_steps=16, decode_batch=8, sync=lambda: syncs.append(1))
    assert p.forward_s_per_token == pytest.approx(1e-3)
    assert p.train_s_per_token == pytest.approx(3e-3) and p.optimizer_s == pytest.approx(0.5)
    assert p.decode_s_per_token == pytest.approx(2e-3) and p.decode_batch == 8
    # four operators timed (log-probs, update, long and short generate): warm-up + 1 call each, every call
    # after a sync with the node's other workers
    assert len(syncs) == 8


def test_slowest_takes_every_cost_from_the_slowest_worker():
    a = [DevicePoint(1, 8, 64, 1.0, 4.0, 2.0, 8, 0.3), DevicePoint(1, 4, 32, 1.0, 1.0, 1.0, 4, 0.1)]
    b = [DevicePoint(1, 8, 64, 1.5, 3.0, 2.5, 8, 0.2), DevicePoint(1, 4, 32, 0.5, 2.0, 0.5, 4, 0.4)]
    assert slowest([a, b]) == [
        DevicePoint(1, 8, 64, 1.5, 4.0, 2.5, 8, 0.3),
        DevicePoint(1, 4, 32, 1.0, 2.0, 1.0, 4, 0.4),
    ]


@pytest.mark.slow  # ~15 s: two processes load a tiny model and time its operators in lock step, per shape
def test_profile_as_one_of_two_workers_measures_both_at_once():
    from hybridflow.models import tiny_model_dir
    from hybridflow.planner.measure import profile_device

    prof = profile_device(
        str(tiny_model_dir("llama")), (1,), [(2, 8), (2, 4)], torch.float32, 1, collectives=True, workers=2
    )
    assert [(p.threads, p.batch, p.length, p.decode_batch, p.decode_prompt) for p in prof.points] == [
        (1, 2, 8, 0, 0),
        (1, 2, 4, 0, 0),
    ]  # decode rows: each shape's batch; decode after each shape's length
    for p in prof.points:
        assert min(p.forward_s_per_token, p.train_s_per_token, p.decode_s_per_token) > 0 and p.optimizer_s >= 0
    assert prof.weight_sync_s_per_byte > 0 and prof.allreduce_latency_s > 0
