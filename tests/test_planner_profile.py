"""The run profile (planner/profile.py) on a hand-written metrics.jsonl."""

import json

import pytest

from hybridflow.planner.profile import build_profile, to_markdown, write_profile

ROWS = [
    {"step": 0, "val/score": 0.1},  # validation row: no timing_s/step, not a training step
    {
        "step": 1,
        "timing_s/step": 10.0,
        "timing_s/gen": 4.0,
        "perf/gen_tokens_per_s": 100.0,
        "perf/total_num_tokens": 1000.0,
        "timing_s/update": 5.0,
        "timing_s/reward": 0.5,
    },
    {
        "step": 2,
        "timing_s/step": 6.0,
        "timing_s/gen": 2.0,
        "perf/gen_tokens_per_s": 150.0,
        "perf/total_num_tokens": 1200.0,
        "timing_s/update": 3.0,
        "timing_s/reward": 0.5,
        "timing_s/weight_sync": 0.2,
        "memory/actor_peak_mb": 900.0,
    },
    {
        "step": 3,
        "timing_s/step": 8.0,
        "timing_s/gen": 3.0,
        "perf/gen_tokens_per_s": 100.0,
        "perf/total_num_tokens": 800.0,
        "timing_s/update": 4.0,
        "timing_s/reward": 0.5,
        "timing_s/weight_sync": 0.4,
        "memory/actor_peak_mb": 1100.0,
        "memory/peak_gb/generate": 1.5,
        "memory/peak_gb/update_actor": 2.5,
    },
]


def by_metric():
    return {p.metric: p for p in build_profile(ROWS)}


def test_median_total_and_steps_per_operator():
    prof = by_metric()
    assert prof["timing_s/step"].steps == 3
    assert prof["timing_s/step"].median_s == pytest.approx(8.0)
    assert prof["timing_s/step"].total_s == pytest.approx(24.0)
    assert prof["timing_s/weight_sync"].steps == 2  # not on the first step
    assert prof["timing_s/weight_sync"].median_s == pytest.approx(0.3)
    assert "timing_s/update_critic_on_worker" not in prof  # not timed -> not reported as zero


def test_tokens_per_step_and_rate():
    prof = by_metric()
    gen = prof["timing_s/gen"]  # response tokens: 400, 300, 300 -> median 300 over median 3 s
    assert gen.tokens_per_step == pytest.approx(300.0)
    assert gen.tokens_per_s == pytest.approx(100.0)
    upd = prof["timing_s/update"]  # all tokens: median 1000 over median 4 s
    assert upd.tokens_per_step == pytest.approx(1000.0)
    assert upd.tokens_per_s == pytest.approx(250.0)
    assert prof["timing_s/weight_sync"].tokens_per_s == 0.0


def test_peak_memory_is_the_max_over_steps():
    prof = by_metric()
    assert prof["timing_s/step"].peak_memory == {
        "memory/actor_peak_mb": 1100.0,
        "memory/peak_gb/generate": 1.5,
        "memory/peak_gb/update_actor": 2.5,
    }
    assert prof["timing_s/gen"].peak_memory == {"memory/peak_gb/generate": 1.5}
    assert prof["timing_s/update"].peak_memory == {"memory/peak_gb/update_actor": 2.5}
    assert prof["timing_s/reward"].peak_memory == {}
    md = to_markdown(build_profile(ROWS))
    assert (
        "memory/actor_peak_mb 1100" in md
        and "| 300 | 100.0 | 1.50 |" in md
        and "| 0.500 | 1.50 | 1000 | 2000.0 | - |" in md
    )
    assert "memory/peak_gb/update_actor 2.5" in md


def test_write_profile_files(tmp_path):
    assert write_profile(tmp_path) is None  # no metrics.jsonl
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    md = write_profile(tmp_path)
    assert md == tmp_path / "profile.md"
    assert "| actor_rollout | generate | 3 | 3.000 | 9.00 | 300 | 100.0 | 1.50 |" in md.read_text()
    data = json.loads((tmp_path / "profile.json").read_text())
    assert {d["metric"] for d in data} >= {"timing_s/gen", "timing_s/step", "timing_s/update"}
