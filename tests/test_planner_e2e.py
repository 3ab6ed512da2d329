"""The planner end to end: `hybridflow profile` on a tiny model, and the plan `hybridflow plan` writes
trained through `hybridflow train --config plan.yaml`, its profile carrying peak memory per operator."""

import json

import pytest
from test_planner_search import PROFILE
from test_trainer_cli import base_overrides, read_metrics, run_cli

from hybridflow.cli.main import main
from hybridflow.config.run import RunConfig
from hybridflow.planner.device import DeviceProfile
from hybridflow.utils.config_loader import load_config


def test_profile_command_on_a_tiny_model(tmp_path, capsys):
    from hybridflow.models import tiny_model_dir

    out = tmp_path / "device.json"
    assert (
        main(
            [
                "profile",
                "--model",
                str(tiny_model_dir("llama")),
                "--out",
                str(out),
                "--threads",
                "1,2",
                "--shapes",
                "2x16",
                "--repeats",
                "1",
                "--decode-rows-per-thread",
                "3",
            ]
        )
        == 0
    )
    prof = DeviceProfile.load(out)
    assert [(p.threads, p.batch, p.length, p.decode_batch) for p in prof.points] == [(1, 2, 16, 3), (2, 2, 16, 6)]
    for p in prof.points:
        assert 0 < p.forward_s_per_token < p.train_s_per_token  # a backward costs more than the forward alone
        assert p.decode_s_per_token > 0
    assert prof.allreduce_latency_s > 0 and prof.allreduce_s_per_byte >= 0 and prof.weight_sync_s_per_byte > 0
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.slow  # ~17-40 s: a 2-step PPO run on 2 Ray workers
def test_the_written_plan_trains_end_to_end(tmp_path, capsys):
    from hybridflow.models import tiny_model_dir

    profile, plan = tmp_path / "profile.json", tmp_path / "plan.yaml"
    profile.write_text(json.dumps(PROFILE))
    overrides = [
        *base_overrides(str(tiny_model_dir("llama")), tmp_path),
        "algorithm.adv_estimator=gae",
        "trainer.backend=ray",
        "trainer.n_workers_per_node=2",
        "trainer.test_freq=-1",
        "actor.old_log_prob=recompute",  # every operator runs, the old-log-prob pass too (auto skips it in fp32)
    ]
    assert (
        main(
            [
                "plan",
                "--profile",
                str(profile),
                "--params",
                "1e6",
                "--device-memory-gb",
                "10",
                "--out",
                str(plan),
                *overrides,
            ]
        )
        == 0
    )
    assert load_config(RunConfig, plan).trainer.placement == "colocate"
    proc = run_cli(["--config", str(plan)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [r for r in read_metrics(tmp_path) if "timing_s/step" in r]
    assert len(steps) == 2
    for op in ("generate", "old_log_prob", "values", "update_actor", "update_critic"):
        assert all(0.05 < r[f"memory/peak_gb/{op}"] < 64 for r in steps), op  # a worker holds > 50 MB
    rows = {r["metric"]: r for r in json.loads((tmp_path / "logs" / "profile.json").read_text())}
    assert rows["timing_s/update_critic_on_worker"]["peak_memory"]["memory/peak_gb/update_critic"] > 0.05


def test_device_profile_rounds_interleave_thread_counts_and_keep_each_best(monkeypatch):
    """Every round measures every thread count before the next round starts (a slow spell hits both sides of
    a speedup ratio), and each operator keeps its best time over the rounds."""
    from hybridflow.planner import device

    calls, times = [], iter([3.0, 2.0, 1.0, 4.0, 2.5, 1.5])  # round 1: threads 1, 2; round 2: 1, 2 ...
    monkeypatch.setattr(
        device,
        "measure_point",
        lambda ops, t, b, n, repeats, decode_batch, warm: (
            calls.append(t),
            device.DevicePoint(t, b, n, next(times), 10.0 - len(calls), 1.0, decode_batch),
        )[1],
    )
    points = device.interleaved_points(None, (1, 2), [(2, 16)], rounds=3, decode_rows_per_thread=4)
    assert calls == [1, 2, 1, 2, 1, 2]
    assert sorted(p.decode_batch for p in points) == [4, 8]  # a 2-thread worker decodes twice the rows
    by = {p.threads: p for p in points}
    assert by[1].forward_s_per_token == 1.0 and by[2].forward_s_per_token == 1.5  # min of 3.0/1.0/2.5, 2.0/4.0/1.5
    assert by[1].train_s_per_token == 5.0 and by[2].train_s_per_token == 4.0  # the later rounds' (smaller) values


def test_profile_leaves_no_process_group_behind():
    """The controller profiles for trainer.placement=auto before it starts workers: the engine's world-size-1
    group must be gone afterwards, or the in-process backend's own init would find one open. Run in a fresh
    process (earlier tests in this one may have left a group open)."""
    import subprocess
    import sys

    from hybridflow.models import tiny_model_dir

    code = (
        "import torch.distributed as dist\n"
        "from hybridflow.planner.measure import profile_device\n"
        f"prof = profile_device({str(tiny_model_dir('llama'))!r}, (1,), [(2, 8)], repeats=1, collectives=False)\n"
        "assert prof.points[0].train_s_per_token > 0\n"
        "print('open after profile:', dist.is_initialized())\n"
    )
    import os

    # a controller has no rendezvous variables; earlier tests in this process may have set them
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "open after profile: False" in out.stdout
