"""Pipeline parallel in `hybridflow train` (GAE with a KL loss, 2 workers, colocated): the actor, its reference and
the critic at pp 2. The N-D dispatch gives both stages of the dp group its rows and collects the last stage's, the
rollout takes the stages' gathered weights after each update, and the run equals one whose actor and critic are
tensor parallel (the same single dp group, so the same mini-batches) step for step, in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.models import tiny_model_dir
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli

COMPARED = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "critic/values/mean",
    "critic/vf_loss",
    "critic/grad_norm",
)


def _run(tmp: Path, layout: str) -> list[dict]:
    fp32 = [f"{k}=fp32" for k in ("actor.engine.param_dtype", "critic.engine.param_dtype", "ref.param_dtype")]
    args = [*base_overrides(str(tiny_model_dir("llama")), tmp), *fp32, "rollout.dtype=fp32"]
    args += ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "actor.optim.lr=1e-3"]
    args += ["trainer.n_workers_per_node=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    args += [f"actor.engine.{layout}", f"critic.engine.{layout}"]
    tmp.mkdir(parents=True)
    done = run_cli(args, tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return [m for m in read_metrics(tmp) if "actor/pg_loss" in m]


@pytest.mark.slow  # two 2-step runs with Ray workers, ~40 s each on 2 CPU cores
def test_actor_ref_and_critic_at_pp2_train_as_at_tp2(tmp_path):
    pp = _run(tmp_path / "pp", "pipeline_model_parallel_size=2")
    tp = _run(tmp_path / "tp", "tensor_parallel_size=2")
    assert [m["step"] for m in pp] == [m["step"] for m in tp] == [1, 2]
    for got, want in zip(pp, tp):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
        assert got["actor/kl_loss"] > 0 or got["step"] == 1  # the actor moved; step 2 generated with synced weights
        assert got["actor/rollout_probs_diff_mean"] < 1e-6  # the rollout holds the weights the trainer computes with
