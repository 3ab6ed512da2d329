"""Data and rewards that cannot lie: a bad row fails when the dataset loads, naming its file, row and column; a
non-finite reward stops the run at its step naming the row (or is dropped and counted, reward.non_finite=drop);
updates that keep skipping stop the run (trainer.max_skipped_updates); a Ray that times out starting is retried
within trainer.ray_start_timeout_s. The CLI runs are real `hybridflow train` runs on the tiny model."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from hybridflow.controller.ray.start import RayStartTimeout, start_ray
from hybridflow.data.dataset import RLDataset
from hybridflow.data.sft import SFTDataset
from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.protocol import DataProto, keys
from hybridflow.rewards.manager import NonFiniteRewardError, RewardManager
from hybridflow.train.skip_guard import SkipGuard
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli

GOOD = {
    "data_source": "arithmetic",
    "prompt": [{"role": "user", "content": "1+1?"}],
    "reward_model": {"ground_truth": "2"},
    "extra_info": {"index": 0},
}


def _parquet(path: Path, rows: list[dict]) -> str:
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model_dir("llama"))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"extra_info": "index=3"}, "row 1: column 'extra_info' must be a dict (a parquet struct) or null, got a str"),
        ({"prompt": [{"role": "user"}]}, "row 1: column 'prompt' must be a non-empty list of {'role', 'content'}"),
        ({"prompt": []}, "row 1: column 'prompt' must be a non-empty list"),
        ({"data_source": ""}, "row 1: column 'data_source' is empty"),
        ({"reward_model": {"style": "rule"}}, "row 1: column 'reward_model' has no 'ground_truth'"),
    ],
)
def test_a_bad_rl_row_fails_at_load_naming_file_row_and_column(tmp_path, tokenizer, bad, message):
    rows = [GOOD, {**GOOD, **bad}]
    if "extra_info" in bad:  # a column of strings and structs cannot be one parquet column
        rows = [{**GOOD, "extra_info": None}, {**GOOD, **bad}]
    path = _parquet(tmp_path / "rows.parquet", rows)
    with pytest.raises(ValueError) as info:
        RLDataset(path, tokenizer, max_prompt_length=64)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "bad, kw, message",
    [
        ({"response": None}, {}, "row 1: no value at 'response'"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
            {"messages_key": "messages"},
            "row 1: column 'messages' must be a non-empty list of {'role', 'content'} messages with string values",
        ),
    ],
)
def test_a_bad_sft_row_fails_at_load_naming_file_row_and_column(tmp_path, tokenizer, bad, kw, message):
    good = {
        "prompt": "1+1?",
        "response": "2",
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    }
    path = _parquet(tmp_path / "sft.parquet", [good, {**good, **bad}])
    with pytest.raises(ValueError, match="row 1") as info:
        SFTDataset(path, tokenizer, max_length=64, **kw)
    assert message in str(info.value)


def _scored(tokenizer, scores: list[float], non_finite: str) -> tuple[DataProto, object]:
    n = len(scores)
    data = DataProto.from_dict(
        {keys.RESPONSES: torch.full((n, 3), 5), keys.RESPONSE_MASK: torch.ones(n, 3, dtype=torch.long)},
        {
            keys.DATA_SOURCE: ["arithmetic"] * n,
            keys.GROUND_TRUTH: ["2"] * n,
            keys.EXTRA_INFO: [{}] * n,
            "index": list(range(10, 10 + n)),
        },
        {keys.META_GLOBAL_STEP: 7},
    )
    fn = iter(scores)
    manager = RewardManager(tokenizer, lambda *args: next(fn), non_finite=non_finite)
    return data, manager(data) if non_finite == "drop" else manager


def test_a_nan_reward_names_the_step_and_row_or_is_dropped_and_counted(tokenizer):
    data, manager = _scored(tokenizer, [1.0, math.nan, math.inf], "error")
    with pytest.raises(NonFiniteRewardError) as info:
        manager(data)
    assert str(info.value).startswith(
        "at step 7, the reward function returned nan for row 1 of the batch (data_source='arithmetic', "
        "dataset index=11; 2 of 3 rows are non-finite)"
    )
    data, result = _scored(tokenizer, [1.0, math.nan, math.inf], "drop")
    assert result.scores == [1.0, 0.0, 0.0] and result.metrics["reward/non_finite_dropped"] == 2.0
    assert torch.isfinite(result.token_level_scores).all()
    assert result.dropped == [1, 2]  # the trainer zeroes their response_mask: they train nothing


def test_skip_guard_counts_steps_in_a_row():
    guard = SkipGuard(3)
    for step, skipped in [(1, 1.0), (2, 1.0), (3, 0.0), (4, 0.5), (5, 1.0)]:
        assert guard.check(step, {"actor/update_skipped": skipped}) is None
    assert guard.check(6, {"critic/update_skipped": 1.0}).startswith("steps 4-6: 3 updates in a row skipped")
    assert SkipGuard(0).check(1, {"actor/update_skipped": 1.0}) is None


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_timed_out_ray_start_is_retried_and_its_processes_stopped():
    """Ray's own error text, raised by a stand-in for ray.init that also starts a process (as Ray's node
    would): the process is stopped before the next attempt, and the second attempt's success ends the retry."""
    started: list[subprocess.Popen] = []

    def init(**kwargs):
        if not started:
            started.append(_sleeper())
            raise Exception("The current node timed out during startup. This could happen because ...")
        started.append(kwargs)

    start_ray(init, 60.0, num_cpus=1)
    assert started[0].wait(timeout=10) is not None and started[1] == {"num_cpus": 1}


def test_a_ray_start_past_its_budget_fails_in_one_line_and_other_errors_pass_through():
    procs: list[subprocess.Popen] = []

    def init(**kwargs):
        procs.append(_sleeper())
        raise Exception("The current node timed out during startup.")

    with pytest.raises(RayStartTimeout) as info:
        start_ray(init, 0.0)  # spent once the first attempt fails
    assert str(info.value).startswith("Ray did not start within 0 s (1 attempt(s); Ray gives its node 30 s each")
    assert "close other programs or allow a longer start" in str(info.value)
    assert len(procs) == 1 and procs[0].wait(timeout=10) is not None

    def broken(**kwargs):
        raise ValueError("num_cpus must be >= 0")

    with pytest.raises(ValueError, match="num_cpus"):
        start_ray(broken, 60.0)


# --- real `hybridflow train` runs --------------------------------------------------------------------------


def _train(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    model = str(tiny_model_dir("llama"))
    args = base_overrides(model, tmp) + [
        "trainer.backend=local",
        "trainer.n_workers_per_node=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        *extra,
    ]
    return run_cli(args, tmp)


def _one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow train: error: "), last
    return last


def test_train_refuses_a_row_without_a_scorer_before_any_worker_starts(tmp_path):
    path = _parquet(tmp_path / "train.parquet", [GOOD, {**GOOD, "data_source": "my_task"}] * 2)
    line = _one_line(_train(tmp_path, f"data.train_files={path}", "data.train_batch_size=2"), 2)
    assert f"{path}: row 1: column 'data_source' is 'my_task', which no rule scorer handles" in line
    assert "reward.custom_reward_function.path" in line
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()


def test_train_refuses_an_extra_info_that_is_not_a_dict_in_one_line(tmp_path):
    path = _parquet(tmp_path / "train.parquet", [{**GOOD, "extra_info": "x"}] * 4)
    line = _one_line(_train(tmp_path, f"data.train_files={path}"), 2)
    assert f"{path}: row 0: column 'extra_info' must be a dict" in line


NAN_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return float('nan') if int(extra_info['index']) % 2 else 1.0\n"
)
HUGE_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1e30\n"


@pytest.mark.slow  # a real run to its first reward, ~30 s on 2 loaded cores
def test_a_nan_reward_stops_the_run_at_its_step_naming_the_row(tmp_path):
    reward = tmp_path / "nan_reward.py"
    reward.write_text(NAN_REWARD)
    line = _one_line(_train(tmp_path, f"reward.custom_reward_function.path={reward}"), 1)
    assert "error: at step 1, the reward function returned nan for row" in line
    assert "set reward.non_finite=drop" in line


@pytest.mark.slow  # two real steps
def test_dropped_nan_rewards_are_counted_and_the_updates_go_on(tmp_path):
    reward = tmp_path / "nan_reward.py"
    reward.write_text(NAN_REWARD)
    proc = _train(tmp_path, f"reward.custom_reward_function.path={reward}", "reward.non_finite=drop")
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    dropped = [r["reward/non_finite_dropped"] for r in steps]
    assert sum(dropped) > 0 and all(d in (0.0, 2.0, 4.0, 6.0, 8.0) for d in dropped)  # 2 samples share an index
    assert [r["actor/update_skipped"] for r in steps] == [0.0, 0.0]


@pytest.mark.slow  # two real steps
def test_updates_that_keep_skipping_stop_the_run(tmp_path):
    """A reward of 1e30 overflows the critic's squared error: its gradient norm is inf at every step."""
    reward = tmp_path / "huge_reward.py"
    reward.write_text(HUGE_REWARD)
    extra = ["algorithm.adv_estimator=gae", "trainer.total_training_steps=4", "trainer.max_skipped_updates=2"]
    line = _one_line(_train(tmp_path, f"reward.custom_reward_function.path={reward}", *extra), 1)
    assert "error: steps 1-2: 2 updates in a row skipped their optimizer step (critic/update_skipped > 0" in line
    assert [r["critic/update_skipped"] for r in read_metrics(tmp_path) if "step" in r] == [1.0, 1.0]
