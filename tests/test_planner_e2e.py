"""The planner end to end: `hybridflow profile` on a tiny model, and the plan `hybridflow plan` writes
trained through `hybridflow train --config plan.yaml`, its profile carrying peak memory per operator."""

import json

import pytest

from hybridflow.config_utils import load_config
from hybridflow.planner.device import DeviceProfile
from hybridflow.trainer.cli import main
from hybridflow.trainer.run_config import RunConfig
from test_planner_search import PROFILE
from test_trainer_cli import base_overrides, read_metrics, run_cli


def test_profile_command_on_a_tiny_model(tmp_path, capsys):
    from hybridflow.models import tiny_model_dir

    out = tmp_path / "device.json"
    assert main(["profile", "--model", str(tiny_model_dir("llama")), "--out", str(out), "--threads", "1,2",
                 "--shapes", "2x16", "--repeats", "1"]) == 0
    prof = DeviceProfile.load(out)
    assert [(p.threads, p.batch, p.length) for p in prof.points] == [(1, 2, 16), (2, 2, 16)]
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
    overrides = [*base_overrides(str(tiny_model_dir("llama")), tmp_path), "algorithm.adv_estimator=gae",
                 "trainer.backend=ray", "trainer.n_workers_per_node=2", "trainer.test_freq=-1"]
    assert main(["plan", "--profile", str(profile), "--params", "1e6", "--device-memory-gb", "10",
                 "--out", str(plan), *overrides]) == 0
    assert load_config(RunConfig, plan).trainer.placement == "colocate"
    proc = run_cli(["--config", str(plan)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [r for r in read_metrics(tmp_path) if "timing_s/step" in r]
    assert len(steps) == 2
    for op in ("generate", "old_log_prob", "values", "update_actor", "update_critic"):
        assert all(0.05 < r[f"memory/peak_gb/{op}"] < 64 for r in steps), op  # a worker holds > 50 MB
    rows = {r["metric"]: r for r in json.loads((tmp_path / "logs" / "profile.json").read_text())}
    assert rows["timing_s/update_critic_on_worker"]["peak_memory"]["memory/peak_gb/update_critic"] > 0.05
