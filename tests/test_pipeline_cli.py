"""A pipeline-parallel critic in `hybridflow train` (GAE, 2 workers, colocated with a dp 2 actor): its stages get
their dp group's rows from the N-D dispatch, the last stage's values and metrics come back, and the run equals one
whose critic is tensor parallel (the same single dp group, so the same mini-batches) step for step, in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.models import tiny_model_dir
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli

CRITIC_KEYS = ("critic/values/mean", "critic/values/max", "critic/vf_loss", "critic/grad_norm", "actor/pg_loss")


def _run(tiny_model: str, tmp: Path, layout: str) -> list[dict]:
    fp32 = ["actor.engine.param_dtype=fp32", "critic.engine.param_dtype=fp32", "rollout.dtype=fp32"]
    args = [*base_overrides(tiny_model, tmp), *fp32, "algorithm.adv_estimator=gae", "trainer.n_workers_per_node=2"]
    args += ["trainer.test_freq=-1", "trainer.val_before_train=false", layout]
    tmp.mkdir(parents=True, exist_ok=True)
    done = run_cli(args, tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return [m for m in read_metrics(tmp) if "critic/vf_loss" in m]


@pytest.mark.slow  # two 2-step runs with Ray workers, ~40 s each on 2 CPU cores
def test_critic_pp2_trains_as_critic_tp2(tmp_path):
    model = str(tiny_model_dir("llama"))
    pp = _run(model, tmp_path / "pp", "critic.engine.pipeline_model_parallel_size=2")
    tp = _run(model, tmp_path / "tp", "critic.engine.tensor_parallel_size=2")
    assert [m["step"] for m in pp] == [m["step"] for m in tp] == [1, 2]
    for got, want in zip(pp, tp):
        for key in CRITIC_KEYS:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
