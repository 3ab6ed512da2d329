"""The main job's loop on a CUDA GPU, in process (trainer.backend=local: no Ray needed on the GPU box).

Skipped without a CUDA device; run with `pytest -m gpu` where there is one. A tiny random Llama, 2 steps:
GRPO with the sampler's log-probs (the mismatch metrics compare them with the trainer's on the GPU) and
a checkpoint, then GAE with a critic and the hf rollout.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_trainer_cli import base_overrides, read_metrics, run_cli

from hybridflow.models import tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ON_GPU = ["trainer.device=cuda", "trainer.backend=local", "trainer.n_workers_per_node=1", "trainer.save_freq=2"]


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.rollout_is_threshold=2.0", "rollout.calculate_log_probs=true"],
        ["algorithm.adv_estimator=gae", "rollout.name=hf"],
    ],
    ids=["grpo-native", "gae-hf"],
)
def test_the_main_job_runs_on_a_gpu(tmp_path: Path, extra: list[str]):
    args = [*base_overrides(str(tiny_model_dir("llama")), tmp_path), *ON_GPU, *extra]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    if "rollout.calculate_log_probs=true" in extra:
        assert all(abs(r["mismatch/kl"]) < 1e-2 for r in rows if "mismatch/kl" in r)
    assert (tmp_path / "ckpt" / "global_step_2").is_dir()
