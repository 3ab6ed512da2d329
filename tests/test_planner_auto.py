"""trainer.placement=auto / n_workers_per_node=null: measured (config/measure.py), then chosen by resolve from the
planner's predictions (planner/auto.py, config/layout.py)."""

from dataclasses import replace

import pytest

from hybridflow.config.measure import Measurements
from hybridflow.config.plan_inputs import run_shape
from hybridflow.config.resolve import resolve
from hybridflow.config.run import RunConfig
from hybridflow.models import tiny_model_dir
from hybridflow.planner.auto import predicted_placements
from hybridflow.planner.device import DevicePoint, DeviceProfile
from hybridflow.utils.config_loader import load_config
from tests.resolve_helpers import resolve_here

PPO = [
    "algorithm.adv_estimator=gae",
    "trainer.n_workers_per_node=2",
    "trainer.cpus_per_worker=1",
    "data.train_batch_size=4",
    "rollout.n=2",
    "data.max_prompt_length=8",
    "data.max_response_length=4",
    "actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
]


@pytest.fixture
def device(tmp_path):
    path = tmp_path / "device.json"
    DeviceProfile("m", "float32", [DevicePoint(1, 2, 64, 0.01, 0.03, 0.05)]).save(path)
    return path


def test_predictions_of_the_runnable_placements(device):
    cfg = load_config(RunConfig, None, PPO)
    # 8 samples: 96 tokens, 32 response tokens; colocate on 2 workers: gen 0.05*32/2, forward (values; the old
    # log-probs are the rollout's, actor.old_log_prob=auto) 0.01*96/2, updates 2 * 0.03*96/2; split 1+1:
    # everything on 1 worker, the roles overlapping
    assert not run_shape(cfg).recompute_old_log_prob
    got = predicted_placements(run_shape(cfg), 1, DeviceProfile.load(device), params=0.0)
    assert got == pytest.approx({"colocate": 0.8 + 0.48 + 2.88, "split": 1.6 + 0.96 + 2.88})


def test_predictions_leave_out_old_log_probs_the_rollout_gives(device):
    shape = run_shape(load_config(RunConfig, None, PPO))
    profile = DeviceProfile.load(device)
    recompute = predicted_placements(replace(shape, recompute_old_log_prob=True), 1, profile, params=0.0)
    rollout = predicted_placements(replace(shape, recompute_old_log_prob=False), 1, profile, params=0.0)
    # colocate: the old log-prob pass is 0.01 x 96 tokens / 2 workers; split: the critic's values pass overlaps it
    assert recompute["colocate"] - rollout["colocate"] == pytest.approx(0.48)
    assert recompute["split"] == pytest.approx(rollout["split"])


def test_auto_resolves_to_a_runnable_placement(device):
    cfg = load_config(RunConfig, None, [*PPO, "trainer.placement=auto", f"trainer.device_profile={device}"])
    assert resolve_here(cfg, 10).config.trainer.placement == "colocate"
    off = load_config(RunConfig, None, [*PPO, "trainer.placement=auto", "trainer.mode=one_step_off"])
    run = resolve_here(off, 10)  # off-policy: the rollout needs its own workers, no profile needed
    assert run.config.trainer.placement == "split" and [s.roles for s in run.worker_sets][1] == ("rollout",)


@pytest.mark.parametrize("two_thread_speedup, chosen", [(1.9, 1), (1.2, 2)])
def test_null_workers_picks_the_layout_the_cost_model_prefers(tmp_path, capsys, two_thread_speedup, chosen):
    # the same per-token costs at 1 thread; at 2 threads faster by `two_thread_speedup`; two workers pay
    # a gradient all-reduce per update (0.5 s per call + 1 s/GB): a near-linear speedup picks 1 x 2, a poor one 2 x 1
    one = DevicePoint(1, 8, 64, 0.01, 0.03, 0.05)
    two = DevicePoint(2, 8, 64, *(x / two_thread_speedup for x in (0.01, 0.03, 0.05)))
    path = tmp_path / "device.json"
    DeviceProfile("m", "float32", [one, two], allreduce_latency_s=0.5, allreduce_s_per_byte=1e-9).save(path)
    overrides = [o for o in PPO if not o.startswith("trainer.n_workers") and not o.startswith("trainer.cpus")]
    cfg = load_config(
        RunConfig,
        None,
        [
            *overrides,
            "trainer.n_workers_per_node=null",
            f"trainer.device_profile={path}",
            f"model.path={tiny_model_dir('llama')}",
        ],
    )
    assert cfg.world_size == 0  # not chosen yet: the batch checks wait for resolve
    run = resolve_here(cfg, 10, cpu_count=2)
    assert run.config.trainer.n_workers_per_node == chosen and run.config.trainer.cpus_per_worker == 2 // chosen
    assert run.notes[0].startswith(f"trainer.n_workers_per_node=null -> {chosen} (predicted s/step: ")
    assert capsys.readouterr().out == ""  # resolve prints nothing: the CLI logs the notes on stderr


@pytest.mark.parametrize("one_worker_s, chosen", [(9.0, 2), (8.5, 1), (11.0, 2)])
def test_null_workers_keeps_the_default_layout_inside_the_noise(tmp_path, monkeypatch, one_worker_s, chosen):
    """Predicted 10.0 s a step for the default 2 x 1: 1 x 2 is chosen only where predicted over 15% faster."""
    from hybridflow.config import layout

    monkeypatch.setattr(
        layout, "predicted_placements", lambda shape, threads, *_: {"colocate": one_worker_s if threads == 2 else 10.0}
    )
    path = tmp_path / "device.json"
    DeviceProfile("m", "float32", [DevicePoint(1, 8, 64, 0.01, 0.03, 0.05)]).save(path)
    overrides = [o for o in PPO if not o.startswith("trainer.n_workers") and not o.startswith("trainer.cpus")]
    args = [*overrides, "trainer.n_workers_per_node=null", f"trainer.device_profile={path}"]
    run = resolve_here(load_config(RunConfig, None, args), 10, cpu_count=2)
    assert run.config.trainer.n_workers_per_node == chosen
    assert ("the default, 1 not predicted over 15% faster" in run.notes[0]) == (one_worker_s == 9.0)


def test_resolve_is_pure_given_measurements(capsys):
    """Profiles and the machine's size come in as values: resolve reads no file and prints nothing."""
    fast_split = DeviceProfile("m", "float32", [DevicePoint(1, 8, 64, 0.01, 0.03, 0.05)])
    base = [o for o in PPO if not o.startswith("trainer.n_workers") and not o.startswith("trainer.cpus")]
    cfg = load_config(
        RunConfig,
        None,
        [*base, "trainer.n_workers_per_node=null", "trainer.placement=auto", "trainer.device_profile=x"],
    )
    measured = Measurements(2, auto_dtypes={1: "fp32", 2: "fp32"}, device_profiles={1: fast_split, 2: fast_split})
    run = resolve(cfg, 10, measured)
    t = run.config.trainer
    assert (t.n_workers_per_node, t.cpus_per_worker, t.placement) == (2, 1, "colocate")
    assert run.config.actor.engine.param_dtype == "fp32" and len(run.notes) == 2
    assert capsys.readouterr() == ("", "")
    with pytest.raises(ValueError, match="not measured at 1 threads"):
        resolve(cfg, 10, Measurements(2, device_profiles={1: fast_split, 2: fast_split}))


def test_null_workers_with_threads_given_or_on_the_local_backend_needs_no_search():
    base = [o for o in PPO if not o.startswith("trainer.n_workers") and not o.startswith("trainer.cpus")]
    cfg = load_config(RunConfig, None, [*base, "trainer.n_workers_per_node=null", "trainer.cpus_per_worker=1"])
    assert resolve_here(cfg, 10, cpu_count=4).config.trainer.n_workers_per_node == 4
    local = load_config(RunConfig, None, [*base, "trainer.n_workers_per_node=null", "trainer.backend=local"])
    assert resolve_here(local, 10, cpu_count=4).config.trainer.n_workers_per_node == 1


@pytest.mark.slow  # ~17 s under load: loads the model and times it
def test_auto_measures_and_caches_a_device_profile(tmp_path, monkeypatch):
    from hybridflow.models import default, tiny_model_dir
    from hybridflow.planner import auto

    monkeypatch.setattr(default, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(auto, "cache_root", lambda: tmp_path)  # auto.py imports it by name
    cfg = load_config(RunConfig, None, [*PPO, "trainer.placement=auto", f"model.path={tiny_model_dir('llama')}"])
    chosen = resolve_here(cfg, 10).config.trainer.placement  # which one wins depends on this machine's figures
    assert chosen in ("colocate", "split")
    (cached,) = (tmp_path / "device_profiles").glob("*.json")
    prof = DeviceProfile.load(cached)
    assert [p.threads for p in prof.points] == [1] and prof.points[0].train_s_per_token > prof.points[
        0
    ].forward_s_per_token
    # the collectives FSDP pays between workers are measured too
    assert prof.allreduce_latency_s > 0 and prof.allgather_s_per_byte > 0 and prof.reducescatter_s_per_byte > 0
    assert resolve_here(cfg, 10).config.trainer.placement == chosen  # the cached profile: the same choice, no new file
    assert len(list((tmp_path / "device_profiles").glob("*.json"))) == 1
