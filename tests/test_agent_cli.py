"""`hybridflow train` with rollout.multi_turn: a custom environment from a .py file on Ray workers, one that
raises (the run fails with one line naming the environment and the row), and the off-policy modes (the loop
on the rollout's own workers, its batches generated ahead)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hybridflow.agent.loop.tokens import observation_ids
from hybridflow.models import load_tokenizer
from hybridflow.protocol import keys as K
from hybridflow.train.async_pipeline import _load_queued
from tests.test_agent_rollout import runs, stopping_model
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli

ENV_FILE = '''
import json
import os
from pathlib import Path

from hybridflow.agent.loop.env import Environment, ResetResult, StepResult


class Echo(Environment):
    """Two tool replies, then done with reward 1 if the row's data_source reached the worker."""

    def __init__(self, max_tool_response_length: int = 0) -> None:
        self.seen = 0
        Path(__file__).with_name("env_pids").open("a").write(f"{os.getpid()}\\n")

    def reset(self, row):
        self.row = row
        return ResetResult(list(row["prompt"]))

    def step(self, text):
        self.seen += 1
        if self.seen >= 3:
            return StepResult(reward=float(self.row["data_source"] == "arithmetic"), done=True)
        return StepResult([{"role": "tool", "content": "ok"}], info={"tool_calls": 1})


class Slow(Echo):
    """Echo whose replies take 2 s, so that a generation is still running when the actor's update lands."""

    def step(self, text):
        import time

        time.sleep(2.0)
        return super().step(text)


class Broken(Echo):
    def step(self, text):
        raise KeyError("no such thing")
'''


def multi_turn_args(tmp_path: Path, env: str, workers: int = 1, source: Path | None = None) -> list[str]:
    """Overrides of a 2-step multi-turn run of ENV_FILE's `env` on the tiny model (or the one at `source`)."""
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    model, _ = stopping_model(tmp_path, source)
    return [
        *base_overrides(model, tmp_path),
        "data.max_response_length=32",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.max_turn_tokens=8",
        f"rollout.multi_turn.env=my_env.py:{env}",
        "trainer.plugins=[my_env.py]",
        f"trainer.n_workers_per_node={workers}",
        "trainer.val_before_train=false",
    ]


def test_a_custom_environment_from_a_file_trains_on_ray_workers(tmp_path: Path):
    proc = run_cli(["train", *multi_turn_args(tmp_path, "Echo")], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = read_metrics(tmp_path)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 1 <= r["agent/turns/mean"] <= 3 and "agent/tool_calls/mean" in r
        assert sum(v for k, v in r.items() if k.startswith("agent/stop_reason/")) == pytest.approx(1.0)
    assert any(r["agent/turns/mean"] > 1 for r in steps)
    assert "val-aux/agent/tool_call_rate" in records[-1] and "val-core/arithmetic/acc/mean@1" in records[-1]
    pids = {int(p) for p in (tmp_path / "env_pids").read_text().split()}
    assert os.getpid() not in pids and len(pids) == 1  # built in the (one) Ray worker, not the controller


def test_an_environment_that_raises_fails_the_run_naming_it_and_the_row(tmp_path: Path):
    args = [*multi_turn_args(tmp_path, "Broken"), "trainer.backend=local"]  # the Ray path: the test above
    proc = run_cli(["train", *args], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "failed in step() on dataset row" in line]
    assert lines and "environment '" in lines[-1] and "my_env.py:Broken'" in lines[-1], proc.stderr[-3000:]
    assert "KeyError: 'no such thing'" in lines[-1]


@pytest.mark.slow  # a third CLI run; the tool environment and task have tests of their own (test_agent_env.py)
def test_the_tool_task_trains_with_the_builtin_tool_environment(tmp_path: Path):
    from hybridflow.models import tiny_model_dir

    args = [
        *base_overrides(str(tiny_model_dir("llama")), tmp_path),
        "data.task=tool_arithmetic",
        "data.max_prompt_length=256",
        "rollout.multi_turn.enable=true",
        "trainer.backend=local",
        "trainer.n_workers_per_node=1",
        "trainer.val_before_train=false",
    ]
    proc = run_cli(["train", *args], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = read_metrics(tmp_path)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["agent/turns/mean"] >= 1 and "agent/tool_calls/mean" in r for r in steps)
    assert all(0.0 <= r["agent/env_time_share"] <= 1.0 and r["agent/generate_time_s"] > 0 for r in steps)
    assert "val-core/tool_arithmetic/acc/mean@1" in records[-1] and "val-aux/agent/turns/mean" in records[-1]


@pytest.mark.parametrize(
    "mode",
    [
        ["trainer.mode=one_step_off"],
        pytest.param(["trainer.mode=async", "trainer.max_staleness=2"], marks=pytest.mark.slow),
    ],
    ids=["one_step_off", "async"],
)
def test_multi_turn_trains_off_policy_on_its_own_rollout_workers(tmp_path: Path, mode: list[str]):
    """Step 2's batch is generated (by the initial weights) while step 1 trains; the checkpoint of step 1 holds
    it as it left the rollout worker: sampled turns trained, the environment's replies masked."""
    args = [
        *multi_turn_args(tmp_path, "Echo", workers=2),
        *mode,
        "trainer.placement=split",
        "trainer.save_freq=1",
        "rollout.calculate_log_probs=true",
        "algorithm.rollout_is_threshold=2.0",
        "algorithm.rollout_is=true",
    ]
    proc = run_cli(["train", *args], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = read_metrics(tmp_path)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["async/staleness/max"] for r in steps] == [0.0, 1.0]
    for r in steps:
        assert 1 <= r["agent/turns/mean"] <= 3 and "agent/tool_calls/mean" in r and "mismatch/kl" in r
        assert r["agent/model_tokens/mean"] < r["response_length/mean"]  # observations: context, not trained
    assert max(r["critic/score/max"] for r in steps) == 1.0  # the environment's reward reached the trainer
    assert "val-aux/agent/turns/mean" in records[-1]
    queued = _load_queued(tmp_path / "ckpt" / "global_step_1" / "rollout_queue", 2)
    assert queued.meta_info[K.META_GLOBAL_STEP] == 2
    b, width = queued.batch, queued.batch[K.RESPONSES].shape[1]
    model = str(tmp_path / "model")
    stops = json.loads((tmp_path / "model" / "generation_config.json").read_text())["eos_token_id"]
    obs = observation_ids(load_tokenizer(model), [{"role": "tool", "content": "ok"}], stops)
    observed = 0
    for row in range(len(queued)):
        length = int(b[K.ATTENTION_MASK][row, -width:].sum())
        segments = runs(b[K.RESPONSES][row, :length].tolist(), b[K.RESPONSE_MASK][row, :length].tolist())
        replies = [ids for m, ids in segments if m == 0]
        assert replies == [obs] * len(replies)
        observed += len(replies)
    masked = (b[K.ATTENTION_MASK][:, -width:] == 1) & (b[K.RESPONSE_MASK] == 0)
    assert observed > 0 and masked.any()
    assert (b[K.ROLLOUT_LOG_PROBS][masked] == 0).all() and (b[K.ENV_REWARDS][masked] == 0).all()
    assert torch.all(b[K.ROLLOUT_LOG_PROBS][b[K.RESPONSE_MASK].bool()] < 0)


@pytest.mark.slow  # a Ray run of 2 steps whose environment sleeps
def test_partial_rollout_takes_the_update_mid_trajectory_on_ray(tmp_path: Path):
    """one_step_off + trainer.partial_rollout: step 2's trajectories are in flight (their environment replies take
    2 s) when step 1's update lands; the rollout worker takes the push mid-way and the rows go on under it. The
    queued batch in step 1's checkpoint holds tokens of both versions, the trained ids are the sampled ids, and
    step 2's parity guard compares the log-probs of the tokens sampled by the weights it updates."""
    args = [
        *multi_turn_args(tmp_path, "Slow", workers=2),
        "trainer.mode=one_step_off",
        "trainer.placement=split",
        "trainer.partial_rollout=true",
        "trainer.save_freq=1",
        "rollout.calculate_log_probs=true",
        "rollout.multi_turn.max_turn_tokens=4",
    ]
    proc = run_cli(["train", *args], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["async/partial_rows"] == 0.0 and steps[1]["async/partial_rows"] > 0.0
    assert steps[1]["async/staleness_hist/0"] > 0.0 and steps[1]["async/staleness_hist/1"] > 0.0
    assert steps[1]["parity/logprob_checked"] == 1.0 and steps[1]["parity/logprob_stale_tokens"] > 0
    assert steps[1]["parity/token_mismatch_rows"] == 0.0
    queued = _load_queued(tmp_path / "ckpt" / "global_step_1" / "rollout_queue", 2).batch
    mask = queued[K.RESPONSE_MASK].bool()
    versions = queued[K.TOKEN_POLICY_VERSION]
    assert set(versions[mask].tolist()) == {0, 1} and bool((versions[~mask] == -1).all())
    for row in range(len(mask)):  # a row's versions never go back: 0 ... 0 1 ... 1
        own = versions[row][mask[row]].tolist()
        assert own == sorted(own)
