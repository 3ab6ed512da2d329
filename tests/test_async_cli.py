"""trainer.mode one_step_off / async through the real CLI (real Ray workers, the weight bridge over gloo,
a tiny model): exactness against sync, the staleness cap, and resume. Each run takes tens of seconds on
2 cores, so these are marked slow (run with -m slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import plugin_override
from test_trainer_cli import base_overrides, read_metrics, run_cli

from hybridflow.models import tiny_model_dir

pytestmark = pytest.mark.slow

# One thread per worker in every run, so the matmuls of the 1-worker sync run and of the 1 + 1 worker
# async run are the same computations (a different thread count may change float reduction order).
COMMON = [
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "actor.optim.lr=1e-3",
    "trainer.cpus_per_worker=1",
    "rollout.calculate_log_probs=true",
    # old log-probs in their own pass in every mode: on a CPU whose probe picks fp32, a sync run's auto would take
    # the rollout's (an off-policy one's cannot), and the sync-vs-async comparisons would compare two methods
    "actor.old_log_prob=recompute",
]
OFF_POLICY = ["trainer.placement=split", "trainer.n_workers_per_node=2"]


def _untimed(record: dict) -> dict:
    """The record without wall-clock values and memory high-water marks (measurements of the machine, not of
    the algorithm), and without the metrics only off-policy modes log."""
    timed = (
        "timing_s/",
        "memory/",
        "perf/time_per_step",
        "perf/throughput",
        "perf/gen_tokens_per_s",
        "async/",
        "weight_transfer/",
        "parity/logprob_stale_rows",
        "parity/logprob_stale_tokens",
        "_time",
        "time",
    )
    return {k: v for k, v in record.items() if not any(k.startswith(t) or k == t for t in timed)}


def _run(tmp: Path, steps: int, *extra: str, ok: bool = True) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    args = base_overrides(str(tiny_model_dir("llama")), tmp) + [
        f"trainer.total_training_steps={steps}",
        *COMMON,
        *extra,
    ]
    proc = run_cli(args, tmp)
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [r for r in read_metrics(tmp) if "actor/pg_loss" in r]


def test_async_with_staleness_zero_is_sync(tmp_path: Path) -> None:
    sync = _run(tmp_path / "sync", 3, "trainer.n_workers_per_node=1")
    off = _run(tmp_path / "async", 3, "trainer.mode=async", "trainer.max_staleness=0", *OFF_POLICY)
    assert [r["step"] for r in off] == [1, 2, 3]
    for want, got in zip(sync, off):
        assert got["async/staleness/max"] == 0.0
        assert got["timing_s/weight_transfer"] > 0
        assert _untimed(got) == _untimed(want), want["step"]


def test_async_staleness_never_exceeds_the_cap(tmp_path: Path) -> None:
    records = _run(
        tmp_path,
        4,
        "trainer.mode=async",
        "trainer.max_staleness=2",
        *OFF_POLICY,
        "algorithm.rollout_is_threshold=2.0",
        "algorithm.rollout_is=true",
    )
    assert [r["async/staleness/max"] for r in records] == [0.0, 1.0, 2.0, 2.0]
    assert all(r["async/staleness_hist/2"] in (0.0, 1.0) for r in records)
    assert all("mismatch/kl" in r and "mismatch/rollout_is_mean" in r for r in records)


@pytest.mark.parametrize(
    "mode, queued, staleness",
    [
        (["trainer.mode=one_step_off"], ["step_3.pt"], [0.0, 1.0, 1.0, 1.0]),
        (["trainer.mode=async", "trainer.max_staleness=2"], ["step_3.pt", "step_4.pt"], [0.0, 1.0, 2.0, 2.0]),
    ],
)
def test_killed_and_resumed_matches_uninterrupted(
    tmp_path: Path, mode: list[str], queued: list[str], staleness: list[float]
) -> None:
    """The actor is SIGKILLed in step 3's update (a later batch is then being generated); the rerun of the
    same command resumes from global_step_2, whose checkpoint holds the batches generated ahead of it."""
    mode = [*mode, *OFF_POLICY, "trainer.save_freq=2", "trainer.max_restarts=0"]
    full = _run(tmp_path / "full", 4, *mode)
    assert [r["async/staleness/max"] for r in full] == staleness
    parts = tmp_path / "parts"
    fault = plugin_override(tmp_path / "plugin", calls="update_actor@3:0", marker_dir=tmp_path / "faults")
    first = _run(parts, 4, *mode, fault, ok=False)
    assert [r["step"] for r in first] == [1, 2]
    assert sorted(p.name for p in (parts / "ckpt" / "global_step_2" / "rollout_queue").iterdir()) == queued
    resumed = _run(parts, 4, *mode, fault)  # the fault fires once; resume_mode=auto picks global_step_2
    by_step = {r["step"]: r for r in first + resumed}
    assert sorted(by_step) == [1, 2, 3, 4]
    for want in full:
        assert _untimed(by_step[want["step"]]) == _untimed(want), want["step"]


def test_one_step_off_feeds_a_tp2_rollout_whole_weights(tmp_path: Path) -> None:
    """The bridge sends whole weights; a rollout split over 2 ranks (each holding only its shard) takes its chunks."""
    records = _run(
        tmp_path,
        2,
        "trainer.mode=one_step_off",
        "trainer.placement=split",
        "trainer.n_workers_per_node=4",
        "rollout.tensor_model_parallel_size=2",
    )
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["timing_s/weight_transfer"] > 0 for r in records)
