"""The parity guard through the real `hybridflow train` CLI on a tiny model: an injected fault stops the run at
its step with the guard's message (and is not retried), trainer.parity=warn goes on. Healthy runs log parity/*
every step: test_trainer_cli.py's `train_ok` checks that for every smoke run."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import plugin_override

from hybridflow.models import tiny_model_dir
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli

LOCAL = ["trainer.backend=local", "trainer.n_workers_per_node=1", "trainer.val_before_train=false"]


def _run(tmp_path: Path, fault: str, *extra: str):
    args = base_overrides(str(tiny_model_dir("llama")), tmp_path) + list(extra)
    return run_cli([*args, plugin_override(tmp_path / "faults", parity=fault)], tmp_path)


def test_a_token_edit_stops_the_run_at_its_step(tmp_path: Path):
    proc = _run(tmp_path, "token_edit@2", *LOCAL)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow train: error: parity check 'tokens' failed at step 2: 1 of 8 rows"), last
    assert "Usual cause: the trained ids are not the ones the model sampled" in last
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["parity/token_mismatch_rows"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, source",
    [
        # two optimizer steps: old log-probs recomputed (on an fp32 CPU auto would take the rollout's)
        (["trainer.val_before_train=false", "actor.old_log_prob=recompute"], "old_log_probs"),
        # one optimizer step per training step: no old log-probs, the update's own forward is compared
        ([*LOCAL, "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4"], "the update's own forward"),
        # fp32 on both sides, two optimizer steps: auto takes the rollout's log-probs, the first step checks them
        ([*LOCAL, "actor.engine.param_dtype=fp32", "rollout.dtype=fp32"], "the update's own forward"),
    ],
)
def test_a_logprob_skew_stops_the_run_and_is_not_retried(tmp_path: Path, extra: list[str], source: str):
    """On Ray (max_restarts 3 by default) a ParityError stops the run without a restart."""
    proc = _run(tmp_path, "logprob_skew@1", *extra)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"error: parity check 'logprobs' failed at step 1: trainer ({source})" in proc.stderr, proc.stderr[-3000:]
    assert "restart 1 of" not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_warn_mode_logs_the_breach_and_trains_on(tmp_path: Path):
    proc = _run(tmp_path, "logprob_skew@1", *LOCAL, "trainer.parity=warn")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parity check 'logprobs' failed at step 1" in proc.stderr
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["parity/logprob_frac_beyond"] == 1.0 and steps[1]["parity/logprob_frac_beyond"] < 1.0
