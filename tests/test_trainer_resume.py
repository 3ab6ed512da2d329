"""Resume: 4 uninterrupted steps vs 2 steps + a resumed run of 2 more log identical metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_cli import base_overrides, read_metrics, run_cli

from hybridflow.models import tiny_model_dir

COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "critic/advantages/mean")


def _run(tmp: Path, steps: int, *extra: str) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    args = base_overrides(str(tiny_model_dir("llama")), tmp) + [
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "actor.optim.lr=1e-3",
        *extra,
    ]
    proc = run_cli(args, tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [r for r in read_metrics(tmp) if "actor/pg_loss" in r]


def test_resume_matches_uninterrupted(tmp_path: Path) -> None:
    full = _run(tmp_path / "full", 4)
    first = _run(tmp_path / "parts", 2)
    assert (tmp_path / "parts" / "ckpt" / "global_step_2" / "COMPLETE").exists()
    resumed = _run(tmp_path / "parts", 4)  # resume_mode=auto picks global_step_2
    assert [r["step"] for r in first + resumed[len(first) :]] == [1, 2, 3, 4]
    by_step = {r["step"]: r for r in first + resumed}
    for ref in full:
        got = by_step[ref["step"]]
        for key in COMPARED:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (ref["step"], key)
