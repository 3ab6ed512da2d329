"""trainer.plugins end to end: a user module registers a policy loss, a group estimator, a reward scorer and a
rollout backend, and a 2-step run on the Ray backend uses all four -- the loss and the rollout inside the
worker processes, which never saw the user's import. A wrong plugin fails at load with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_cli import base_overrides, read_metrics, run_cli

from hybridflow.config.run import RunConfig
from hybridflow.models import tiny_model_dir
from hybridflow.utils.config_loader import ConfigError, load_config

PLUGIN = """
import os
from pathlib import Path

from hybridflow.algos import LOSS_AGG_MODES, get_advantage_estimator, get_policy_loss_fn
from hybridflow.algos import register_adv_est, register_policy_loss
from hybridflow.rewards import register_scorer
from hybridflow.rollout import ROLLOUT_BACKENDS, RolloutBackendSpec

MARKS = Path(__file__).parent / "marks"


def mark(kind):
    MARKS.mkdir(exist_ok=True)
    with open(MARKS / f"{kind}.txt", "a") as f:
        f.write(f"{os.getpid()}\\n")


@register_policy_loss("pid_vanilla")
def pid_vanilla(*args, **kwargs):
    mark("policy_loss")
    loss, stats = get_policy_loss_fn("vanilla")(*args, **kwargs)
    return loss, {**stats, "plugin_pid": float(os.getpid())}


@register_adv_est("halved_grpo", needs_groups=True)
def halved_grpo(token_level_rewards, response_mask, index, **kwargs):
    mark("estimator")
    adv, ret = get_advantage_estimator("grpo")(token_level_rewards, response_mask, index, **kwargs)
    return adv / 2, ret / 2


def constant_score(solution_str, ground_truth):
    mark("scorer")
    return 0.375


register_scorer("arithmetic", constant_score, override=True)


def counting_rollout(config, model, tokenizer, tp_stride):
    rollout = ROLLOUT_BACKENDS.get("native").build(config, model, tokenizer, tp_stride)
    generate = rollout.generate_sequences

    def counted(prompts, sampling=None):
        mark("rollout")
        return generate(prompts, sampling)

    rollout.generate_sequences = counted
    return rollout


ROLLOUT_BACKENDS.register("counting", RolloutBackendSpec(build=counting_rollout))


def marked_token_mean(loss_mat, valid, global_norm, norm_length):  # selected by path, not registered
    mark("loss_agg")
    return LOSS_AGG_MODES.get("token-mean")(loss_mat, valid, global_norm, norm_length)
"""

USE_ALL = [
    "actor.policy_loss_mode=pid_vanilla",
    "algorithm.adv_estimator=halved_grpo",
    "rollout.name=counting",
    "actor.loss_agg_mode=plug.py:marked_token_mean",  # relative: made absolute at load for the workers
]


@pytest.fixture(autouse=True)
def _restore_registries(isolated_registries):
    """plug.py, imported here by the load-time tests, replaces the arithmetic scorer."""


def _pids(tmp: Path, kind: str) -> list[int]:
    return [int(line) for line in (tmp / "marks" / f"{kind}.txt").read_text().split()]


def test_a_ray_run_uses_every_plugin_kind_in_the_workers(tmp_path: Path):
    (tmp_path / "plug.py").write_text(PLUGIN)
    fast = ["trainer.n_workers_per_node=1", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    # A relative plugin path: resolved at load, so the Ray workers (another working directory) find it too.
    args = ["train", *base_overrides(str(tiny_model_dir("llama")), tmp_path), *fast, *USE_ALL]
    proc = run_cli([*args, "trainer.plugins=[plug.py]", "trainer.backend=ray"], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    controller = set(_pids(tmp_path, "estimator"))  # the estimator runs on the controller, once per step
    assert len(_pids(tmp_path, "estimator")) == 2 and len(controller) == 1
    workers = set(_pids(tmp_path, "policy_loss"))
    assert set(_pids(tmp_path, "rollout")) == set(_pids(tmp_path, "loss_agg")) == workers
    assert not workers & controller
    assert {int(r["actor/plugin_pid"]) for r in steps} == workers  # the loss's own stat reached the metrics
    assert all(r["critic/score/mean"] == pytest.approx(0.375) for r in steps)  # every response scored by it
    assert len(_pids(tmp_path, "scorer")) >= 2 * 4 * 2  # 2 steps x 4 prompts x n=2
    assert len(_pids(tmp_path, "rollout")) == 2


def test_the_spec_of_a_plugin_estimator_is_checked_at_load(tmp_path: Path):
    (tmp_path / "plug.py").write_text(PLUGIN)
    plugins = f"trainer.plugins=[{tmp_path / 'plug.py'}]"
    with pytest.raises(ConfigError, match="adv_estimator=halved_grpo compares the samples .* rollout.n >= 2"):
        load_config(RunConfig, None, [plugins, "algorithm.adv_estimator=halved_grpo", "rollout.n=1"])
    cfg = load_config(
        RunConfig, None, [plugins, *USE_ALL[:-1], f"actor.loss_agg_mode={tmp_path}/plug.py:marked_token_mean"]
    )
    assert cfg.trainer.plugins == [str(tmp_path / "plug.py")]


@pytest.mark.parametrize(
    "override, expect",
    [
        ("trainer.plugins=[missing_plugin.py]", "trainer.plugins: plugin file 'missing_plugin.py' does not exist"),
        ("trainer.plugins=[no_such_module_xyz]", "trainer.plugins: cannot import module 'no_such_module_xyz'"),
        ("actor.policy_loss_mode=other.py:nope", "other.py' has no attribute 'nope'; callables there: ['mine']"),
    ],
)
def test_a_wrong_plugin_fails_with_one_line(tmp_path: Path, monkeypatch, capsys, override: str, expect: str):
    from hybridflow.cli.main import main

    (tmp_path / "other.py").write_text("def mine():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", override]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hybridflow train: error: "), lines
    assert expect in lines[0] and override.split("=")[0] in lines[0], lines[0]
