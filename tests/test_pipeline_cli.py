"""Pipeline parallel in `hybridflow train` (GAE with a KL loss, 2 workers, colocated): the actor, its reference and
the critic at pp 2. The N-D dispatch gives both stages of the dp group its rows and collects the last stage's, the
rollout takes the stages' gathered weights after each update, and the run equals one whose actor and critic are
tensor parallel (the same single dp group, so the same mini-batches) step for step, in fp32. A run's checkpoint
resumes at the other layout (pp 2 -> tp 2, tp 2 -> pp 2) with the uninterrupted run's next step."""

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


def _run(tmp: Path, layout: str, *extra: str) -> list[dict]:
    fp32 = [f"{k}=fp32" for k in ("actor.engine.param_dtype", "critic.engine.param_dtype", "ref.param_dtype")]
    args = [*base_overrides(str(tiny_model_dir("llama")), tmp), *fp32, "rollout.dtype=fp32"]
    args += ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "actor.optim.lr=1e-3"]
    args += ["trainer.n_workers_per_node=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    args += [f"actor.engine.{layout}", f"critic.engine.{layout}", *extra]
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


PP, TP = "pipeline_model_parallel_size=2", "tensor_parallel_size=2"


@pytest.mark.slow  # four runs with Ray workers, ~40 s each on 2 CPU cores
def test_a_checkpoint_at_pp2_resumes_at_tp2_and_one_at_tp2_resumes_at_pp2(tmp_path):
    """Step 3 of a run resumed from step 2's checkpoint of the other layout (actor and critic weights and optimizer
    state, the LR schedule, the data and sampling state) equals step 3 of the uninterrupted run."""
    saving = ["trainer.total_training_steps=3", "trainer.save_freq=2"]
    whole = {layout: _run(tmp_path / name, layout, *saving) for name, layout in (("pp", PP), ("tp", TP))}
    for name, layout, source in (("tp_from_pp", TP, "pp"), ("pp_from_tp", PP, "tp")):
        resume = [
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={tmp_path / source / 'ckpt'}/global_step_2",
        ]
        resumed = _run(tmp_path / name, layout, "trainer.total_training_steps=3", *resume)
        assert [m["step"] for m in resumed] == [3], name
        want = whole[layout][2]
        for key in COMPARED:
            assert resumed[0][key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (name, key)
