"""hybridflow.utils: timing, tracking backends, plots, checkpoint directories, progress bar and phase
lines, quiet libraries — on real files and real processes."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.utils import checkpoint_dirs as ckpt
from hybridflow.utils.plot import plot_run, read_metrics, run_figure, summarize_run
from hybridflow.utils.progress import TrainProgress, phase
from hybridflow.utils.quiet import quiet_libraries, worker_env
from hybridflow.utils.timing import reduce_metrics, timer, to_float
from hybridflow.utils.tracking import Tracking

# --- timing ------------------------------------------------------------------


def test_timer_stores_seconds_also_when_the_block_raises():
    timings: dict[str, float] = {}
    with timer("gen", timings):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), timer("update", timings):
        raise RuntimeError("boom")
    assert timings["gen"] >= 0.01
    assert 0 <= timings["update"] < timings["gen"] + 1.0


def test_reduce_metrics_means_lists_tensors_and_scalars():
    grad = torch.tensor(3.0, requires_grad=True) * 2
    values = {"a": [1.0, 2.0, 6.0], "b": [torch.tensor(1.0), grad], "c": torch.tensor([1.0, 3.0])}
    out = reduce_metrics({**values, "d": np.float32(2.5), "e": 4})
    assert out == {"a": 3.0, "b": 3.5, "c": 2.0, "d": 2.5, "e": 4.0}
    assert all(type(v) is float for v in out.values())
    with pytest.raises(ValueError, match="'actor/pg_loss' has no values"):
        reduce_metrics({"actor/pg_loss": []})


def test_to_float_rejects_many_values_and_non_numbers():
    assert to_float(torch.tensor([2.5], dtype=torch.bfloat16)) == 2.5
    with pytest.raises(ValueError, match="'x' has 3 values"):
        to_float([1, 2, 3], "x")
    with pytest.raises(TypeError, match="'y'"):
        to_float("abc", "y")


# --- tracking ----------------------------------------------------------------

STEP_METRICS = {
    "critic/score/mean": torch.tensor(0.5),
    "actor/pg_loss": np.float64(-0.0123),
    "actor/lr": 1e-6,
    "response_length/mean": 31.25,
    "timing_s/step": 2.0,
}


def _jsonl_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_writes_every_step_flushed_and_appends_on_resume(tmp_path):
    config = {"trainer": {"total_steps": 3, "out": Path("/x")}}
    tracker = Tracking("proj", "exp", ["jsonl"], tmp_path, config=config)
    tracker.log(STEP_METRICS, step=1)
    first = _jsonl_lines(tmp_path / "metrics.jsonl")  # readable before finish: flushed
    assert first == [
        {
            "step": 1,
            "critic/score/mean": 0.5,
            "actor/pg_loss": -0.0123,
            "actor/lr": 1e-6,
            "response_length/mean": 31.25,
            "timing_s/step": 2.0,
        }
    ]
    tracker.log({"critic/score/mean": float("nan"), "val-core/arith/acc/mean@1": 0.25}, step=2)
    tracker.finish()
    tracker.finish()  # idempotent
    with Tracking("proj", "exp", "jsonl", tmp_path) as resumed:
        resumed.log({"critic/score/mean": 0.75}, step=2)
    lines = _jsonl_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 2]
    assert lines[1] == {"step": 2, "critic/score/mean": None, "val-core/arith/acc/mean@1": 0.25}
    assert json.loads((tmp_path / "config.json").read_text()) == {"trainer": {"total_steps": 3, "out": "/x"}}
    assert [r["critic/score/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.5, 0.75]


def test_console_prints_one_compact_line_with_key_metrics(tmp_path, capsys):
    with Tracking("proj", "exp", ["console"], tmp_path) as tracker:
        tracker.log({**STEP_METRICS, "val-core/arith/acc/mean@1": 0.4, "val-aux/arith/len": 9.0}, step=3)
    out = capsys.readouterr().out
    assert out == ("step 3 | score 0.5 | pg_loss -0.0123 | resp_len 31.25 | step_s 2 | val-core/arith/acc/mean@1 0.4\n")


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking("proj", "exp", ["tensorboard"], tmp_path, config={"a": 1}) as tracker:
        tracker.log(STEP_METRICS, step=1)
        tracker.log({"critic/score/mean": 0.625}, step=2)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scores = acc.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in scores] == [(1, 0.5), (2, 0.625)]
    assert math.isclose(acc.Scalars("actor/pg_loss")[0].value, -0.0123, rel_tol=1e-6)


def test_bad_logger_names_and_keys_fail_clearly(tmp_path):
    with pytest.raises(
        ValueError, match=r"trainer.logger='tensorbord' is not a registered logger; known: console, jsonl"
    ):
        Tracking("p", "e", ["console", "tensorbord"], tmp_path)
    with Tracking("p", "e", ["console"], tmp_path) as tracker, pytest.raises(ValueError, match="'step' is reserved"):
        tracker.log({"step": 1.0}, step=1)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_optional_logger_not_installed_names_the_pip_package(tmp_path, name):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(ImportError, match=f"pip install {name}"):
        Tracking("p", "e", ["jsonl", name], tmp_path)


# --- plot --------------------------------------------------------------------


def _write_run(log_dir: Path) -> Path:
    """A small run: validation at steps 0 and 4, step 3 logged twice (crash + resume)."""
    with Tracking("p", "e", ["jsonl"], log_dir) as tracker:
        tracker.log({"val-core/arith/acc/mean@1": 0.2}, step=0)
        for step in range(1, 4):
            tracker.log(
                {"critic/score/mean": 0.1 * step, "response_length/mean": 40 - step, "timing_s/step": 1.5}, step=step
            )
    with Tracking("p", "e", ["jsonl"], log_dir) as tracker:
        for step in (3, 4):
            tracker.log(
                {"critic/score/mean": 0.1 * step, "response_length/mean": 40 - step, "timing_s/step": 2.0}, step=step
            )
        tracker.log({"val-core/arith/acc/mean@1": 0.6}, step=4)
    return log_dir / "metrics.jsonl"


def test_plot_run_writes_a_real_png(tmp_path):
    out = plot_run(_write_run(tmp_path / "run"), tmp_path / "plots" / "run.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1500, 420)
    assert len(data) > 20_000  # three panels with lines and text, not an empty canvas


def test_panels_without_data_say_so(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "timing_s/step": 1.0}) + "\n" + '{"step": 2, "crit')  # cut by a crash
    fig = run_figure(read_metrics(path))
    texts = [[t.get_text() for t in ax.texts] for ax in fig.axes]
    assert texts == [["no data"], ["no data"], ["no data"]]
    plot_run(path, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 5_000


def test_summarize_run_reports_first_last_and_time(tmp_path):
    path = _write_run(tmp_path)
    assert summarize_run(path).splitlines() == [
        f"{path}: 5 steps logged (steps 0..4)",
        "reward (critic/score/mean): 0.1 at step 1 -> 0.4 at step 4",
        "val (val-core/arith/acc/mean@1): 0.2 at step 0 -> 0.6 at step 4",
        "response length (response_length/mean): 39 at step 1 -> 36 at step 4",
        "time: 7.0 s total over 4 steps (1.75 s/step)",
    ]
    with pytest.raises(FileNotFoundError, match="'jsonl'"):
        summarize_run(tmp_path / "missing.jsonl")


# --- checkpoint directories ----------------------------------------------------


def _save(root: Path, step: int) -> Path:
    with ckpt.atomic_dir(ckpt.step_dir(root, step)) as tmp:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
    return ckpt.step_dir(root, step)


def test_atomic_dir_commits_with_marker_and_leaves_no_tmp(tmp_path):
    final = _save(tmp_path, 5)
    assert sorted(p.name for p in final.iterdir()) == ["COMPLETE", "MANIFEST.json", "trainer_state.json"]
    assert ckpt.find_latest_complete(tmp_path) == final
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_5"]


def test_exception_inside_atomic_dir_leaves_nothing_visible(tmp_path):
    with pytest.raises(RuntimeError), ckpt.atomic_dir(ckpt.step_dir(tmp_path, 7)) as tmp:
        (tmp / "half.bin").write_bytes(b"x" * 100)
        raise RuntimeError("killed mid-save")
    assert ckpt.find_latest_complete(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_crash_leftovers_are_ignored_and_stale_tmp_removed(tmp_path):
    good = _save(tmp_path, 3)
    crashed = tmp_path / "global_step_9.tmp-999999"  # a save killed before its rename
    crashed.mkdir()
    (crashed / "COMPLETE").write_text("")
    (tmp_path / "global_step_8").mkdir()  # no marker
    assert ckpt.find_latest_complete(tmp_path) == good
    assert ckpt.remove_stale_tmp(tmp_path) == [crashed]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "global_step_8"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_begin_commit_with_torch_distributed_checkpoint_subdirs(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    tmp = ckpt.begin_checkpoint(tmp_path, 2)
    assert tmp.name == f"global_step_2.tmp-{os.getpid()}" and ckpt.find_latest_complete(tmp_path) is None
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp / "actor")
    ckpt.write_json_atomic(tmp / "trainer_state.json", {"global_step": 2})
    final = ckpt.commit_checkpoint(tmp, ckpt.step_dir(tmp_path, 2))
    assert ckpt.find_latest_complete(tmp_path) == final
    restored = {"model": torch.nn.Linear(4, 3).state_dict()}
    dcp.load(restored, checkpoint_id=final / "actor")  # DCP files survive the rename
    assert torch.equal(restored["model"]["weight"], model.weight.detach())


def test_commit_replaces_an_existing_checkpoint_of_the_same_step(tmp_path):
    _save(tmp_path, 4)
    with ckpt.atomic_dir(ckpt.step_dir(tmp_path, 4)) as tmp:
        (tmp / "new.txt").write_text("again")
    assert sorted(p.name for p in ckpt.step_dir(tmp_path, 4).iterdir()) == ["COMPLETE", "MANIFEST.json", "new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_4"]


def test_prune_keeps_the_newest_complete_and_touches_nothing_else(tmp_path):
    for step in (1, 2, 3, 10):
        _save(tmp_path, step)
    (tmp_path / "global_step_0").mkdir()  # incomplete: not a candidate
    (tmp_path / "global_step_0.tmp-1").mkdir()
    (tmp_path / "notes.txt").write_text("keep me")
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["global_step_1", "global_step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_0",
        "global_step_0.tmp-1",
        "global_step_10",
        "global_step_3",
        "notes.txt",
    ]
    assert ckpt.prune_checkpoints(tmp_path, keep_last=5) == []
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ckpt.prune_checkpoints(tmp_path, keep_last=0)


def test_write_json_atomic_keeps_the_old_file_when_serialization_fails(tmp_path):
    path = ckpt.write_json_atomic(tmp_path / "state.json", {"step": 1, "rng": [1, 2]})
    assert json.loads(path.read_text()) == {"step": 1, "rng": [1, 2]}
    with pytest.raises(TypeError):
        ckpt.write_json_atomic(path, {"step": object()})
    assert json.loads(path.read_text()) == {"step": 1, "rng": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


# --- progress bar --------------------------------------------------------------


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_off_without_a_tty_and_with_the_env_switch(monkeypatch):
    stream = io.StringIO()
    with TrainProgress(10, stream=stream) as bar:
        bar.update(STEP_METRICS)
    assert not bar.enabled and stream.getvalue() == ""
    monkeypatch.setenv("HYBRIDFLOW_NO_PROGRESS", "1")
    tty = _FakeTTY()
    with TrainProgress(10, stream=tty, enable=True) as bar:
        bar.update(STEP_METRICS)
    assert not bar.enabled and tty.getvalue() == ""


def test_progress_on_a_tty_shows_steps_and_key_metrics():
    tty = _FakeTTY()
    with TrainProgress(10, initial=2, desc="ppo", stream=tty) as bar:
        bar.update(STEP_METRICS)
        bar.update({**STEP_METRICS, "critic/score/mean": 0.75})
    out = tty.getvalue()  # tqdm may skip redrawing the first update; the final redraw shows the last postfix
    assert bar.enabled and "ppo" in out and "4/10" in out
    assert "score=0.75" in out and "pg_loss=-0.0123" in out and "resp_len=31.25" in out and "step_s=2" in out
    assert "lr" not in out.split("4/10")[-1]


# --- phase lines -----------------------------------------------------------------


def test_phase_in_a_log_is_a_start_line_and_a_result_line():
    log = io.StringIO()
    with phase("loading models", stream=log):
        time.sleep(0.06)
    start, result = log.getvalue().splitlines()
    assert start == "loading models ..."
    assert result.startswith("loading models ... done in ") and result.endswith(" s")
    assert float(result.split("done in ")[1][:-2]) >= 0.1  # slept 0.06 s, printed to 0.1 s
    assert "\r" not in log.getvalue()


def test_phase_on_a_tty_is_one_line_rewritten_in_place():
    tty = _FakeTTY()
    with phase("validating (4 prompts)", stream=tty):
        tty.write("a worker's warning\n")  # output in between must not split the result line
    out = tty.getvalue()
    assert out.startswith("validating (4 prompts) ... a worker's warning\n")
    last = out.split("\r")[-1]
    assert last.startswith("validating (4 prompts) ... done in ") and last.endswith("\x1b[K\n")


def test_phase_reports_a_failure_and_lets_the_error_through():
    log = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"), phase("saving checkpoint global_step_3", stream=log):
        raise RuntimeError("boom")
    assert log.getvalue().splitlines()[-1].startswith("saving checkpoint global_step_3 ... failed after ")


# --- quiet libraries ---------------------------------------------------------------

_LIBRARY_STATE = """
import io, json, tqdm
from transformers.utils import logging
bar = logging.tqdm(range(3), file=io.StringIO())
print(json.dumps({"transformers_bars": not isinstance(bar, logging.EmptyTqdm) and not bar.disable,
                  "tqdm_bars": not tqdm.tqdm(range(3), file=io.StringIO()).disable,
                  "transformers_level": logging.get_verbosity()}))
"""


def _library_state_in_a_fresh_process(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")}
    out = subprocess.run(
        [sys.executable, "-c", _LIBRARY_STATE],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def test_worker_env_switches_bars_and_info_logs_off_in_a_new_process_and_verbose_leaves_them():
    quiet = _library_state_in_a_fresh_process(worker_env(verbose=False))
    assert quiet == {"transformers_bars": False, "tqdm_bars": False, "transformers_level": 30}
    assert worker_env(verbose=True) == {}
    loud = _library_state_in_a_fresh_process(worker_env(verbose=True))
    assert loud["transformers_bars"] and loud["tqdm_bars"]


def test_quiet_libraries_silences_transformers_for_the_block_only():
    from transformers.utils import logging as tf_logging

    before = tf_logging.get_verbosity()
    tf_logging.set_verbosity_info()
    try:
        with quiet_libraries(verbose=False):
            assert tf_logging.get_verbosity() == tf_logging.WARNING
            assert tf_logging.tqdm(range(3), file=io.StringIO()).disable
        assert tf_logging.get_verbosity() == tf_logging.INFO
        with quiet_libraries(verbose=True):
            assert tf_logging.get_verbosity() == tf_logging.INFO
        assert tf_logging.set_tqdm_hook(None) is None  # the hook it installed is gone again
    finally:
        tf_logging.set_verbosity(before)
