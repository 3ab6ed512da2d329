"""bench/tinker_vs_train.py's pieces that need no model: its `hybridflow train` overrides load as a RunConfig, and
its summary reads step times from metrics files shaped like the cookbook's and hybridflow's (the first step left
out of the median). The bench itself runs both trainings (minutes); it is run by hand, see BENCHMARKS.md."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from hybridflow.config.run import RunConfig
from hybridflow.utils.config_loader import load_config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tinker_vs_train", ROOT / "bench" / "tinker_vs_train.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def write(path: Path, records: list[dict]) -> list[dict]:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return bench.read_metrics(path)


def test_the_train_overrides_load_with_the_asked_batch_rank_and_tokens(tmp_path):
    args = argparse.Namespace(prompts=3, group=5, max_tokens=12, lora_rank=4, lr=1e-4, steps=2)
    cfg = load_config(RunConfig, None, bench.train_args(args, tmp_path, "fp32"))
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_response_length) == (3, 5, 12)
    assert (cfg.actor.lora.rank, cfg.trainer.backend, cfg.trainer.n_workers_per_node) == (4, "local", 1)
    assert cfg.data.task == "arithmetic" and cfg.trainer.total_training_steps == 2
    assert (cfg.actor.engine.param_dtype, cfg.rollout.dtype, cfg.actor.lora.alpha) == ("fp32", "fp32", 32)


def test_the_report_takes_medians_after_the_first_step(tmp_path, capsys):
    service = write(
        tmp_path / "cookbook.jsonl",
        [{"time/total": 9.0, "env/all/ob_tokens_per_turn": 30}, {"time/total": 2.0}, {"time/total": 4.0}],
    )
    train = write(tmp_path / "train.jsonl", [{"timing_s/step": 7.0}, {"timing_s/step": 2.0}, {"other": 1}])
    ratio = bench.report(service, train)
    assert ratio == pytest.approx(1.5)  # median(2, 4) = 3 over 2
    out = capsys.readouterr().out
    assert (
        "1.50x" in out
        and "FAIL" in out
        and "service 30.0  train n/a" in out
        and "service vs train" in out
        and "service step / train step: 1.50x" in out
    )


def test_a_metrics_file_without_the_step_key_names_the_key(tmp_path):
    records = write(tmp_path / "m.jsonl", [{"loss": 1.0}])
    with pytest.raises(SystemExit, match="no 'timing_s/step' in the metrics"):
        bench.summarize(records, "timing_s/step")
