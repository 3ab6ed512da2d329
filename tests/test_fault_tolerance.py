"""A run survives worker death: real `hybridflow train` runs (tiny model, 2 Ray workers, 4 steps, checkpoints
at steps 2 and 4) with faults injected at precise points (tests/faults/calls.py, armed by a trainer.plugins module)
finish with exactly the metrics of one uninterrupted reference run, each step logged once.

The rewards come from a length-based scorer, so the tiny random model gets non-zero advantages and its
weights move: a resume that lost the optimizer, the loader position or the RNG would change the metrics.
Default run: the reference, one run whose worker is killed while saving, and a plain resume (a 2-step run, then
the same command for 4 steps picks up its checkpoint); the rest are marked slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import disarm, plugin_override
from test_trainer_cli import base_overrides, cli_env, read_metrics, run_cli

from hybridflow.models import tiny_model_dir

COMPARED = (
    "critic/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/ppo_kl",
    "critic/advantages/mean",
)
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (len(solution_str) % 7) / 7.0\n"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, Path]:
    """(the tiny model's path, a reward file)."""
    reward = tmp_path_factory.mktemp("reward") / "length_reward.py"
    reward.write_text(REWARD)
    return str(tiny_model_dir("llama")), reward


def overrides(setup: tuple[str, Path], tmp: Path, *extra: str) -> list[str]:
    model, reward = setup
    return base_overrides(model, tmp) + [
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "actor.optim.lr=1e-3",
        f"reward.custom_reward_function.path={reward}",
        "trainer.cpus_per_worker=1",
        *extra,
    ]


def armed(tmp: Path, faults: str) -> list[str]:
    """The override that arms worker-fault spec `faults` in every process of the run (markers in tmp/faults)."""
    return [plugin_override(tmp / "plugin", calls=faults, marker_dir=tmp / "faults")] if faults else []


def train(setup: tuple[str, Path], tmp: Path, *extra: str, faults: str = "") -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    proc = run_cli(overrides(setup, tmp, *extra, *armed(tmp, faults)), tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def steps_of(tmp: Path) -> list[dict]:
    return [r for r in read_metrics(tmp) if "actor/pg_loss" in r]


def assert_same_metrics(got: list[dict], ref: list[dict]) -> None:
    """Each step once, in order, with the reference's values."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for mine, theirs in zip(got, ref):
        for key in COMPARED:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (mine["step"], key)


def recovery_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "hybridflow: worker failure:" in line]


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory) -> list[dict]:
    """The uninterrupted run every case is compared with."""
    tmp = tmp_path_factory.mktemp("reference")
    train(setup, tmp)
    ref = steps_of(tmp)
    assert len({r["critic/score/mean"] for r in ref}) > 1 and any(r["actor/grad_norm"] > 0 for r in ref)
    assert all(r["fault/restarts"] == 0 for r in ref)
    return ref


@pytest.mark.slow  # ~83 s with its fixtures on 2 cores: the default suite ran 16m52s with it (house limit 15 min)
def test_a_worker_killed_while_saving_recovers_from_the_last_complete_checkpoint(setup, reference, tmp_path: Path):
    # rank 1 dies inside the step-4 save, after step 3 was logged: global_step_4 is half-written, the run
    # goes back to global_step_2 and redoes steps 3 and 4, and step 3's first record is replaced
    proc = train(setup, tmp_path, faults="save_checkpoint@4:1")
    assert_same_metrics(steps_of(tmp_path), reference)
    (line,) = recovery_lines(proc)
    assert "rank 1 (pid" in line and "node " in line and "died" in line and "save_checkpoint" in line, line
    assert "restart 1 of 3" in line and "global_step_2, redoing steps 3-4" in line, line
    assert steps_of(tmp_path)[-1]["fault/restarts"] == 1 and steps_of(tmp_path)[-1]["fault/steps_redone"] == 2
    assert steps_of(tmp_path)[-1]["fault/recovery_s"] > 0 and "hybridflow: recovered in " in proc.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["global_step_2", "global_step_4"]


@pytest.mark.slow  # two runs (~70 s)
def test_a_resumed_run_logs_the_metrics_of_an_uninterrupted_one(setup, reference, tmp_path: Path):
    # 2 steps, then the same command for 4: resume_mode=auto picks global_step_2 and the run goes on from step 3
    train(setup, tmp_path, "trainer.total_training_steps=2")
    assert [r["step"] for r in steps_of(tmp_path)] == [1, 2]
    assert (tmp_path / "ckpt" / "global_step_2" / "COMPLETE").exists()
    again = train(setup, tmp_path)
    assert "resumed from " in again.stderr and "global_step_2 at step 2" in again.stderr, again.stderr[-3000:]
    assert_same_metrics(steps_of(tmp_path), reference)
    assert all(r["fault/restarts"] == 0 for r in steps_of(tmp_path))


@pytest.mark.slow  # three restarts
def test_workers_killed_in_generate_update_and_save_recover_exactly(setup, reference, tmp_path: Path):
    # step 3's generate (rank 1), then step 4's update (rank 0, step 3 already logged), then step 4's save
    faults = "generate_sequences@3:1,update_actor@4:0,save_checkpoint@4:1"
    proc = train(setup, tmp_path, faults=faults)
    assert_same_metrics(steps_of(tmp_path), reference)
    lines = recovery_lines(proc)
    assert len(lines) == 3, proc.stderr[-5000:]
    for i, (line, method) in enumerate(zip(lines, ("generate_sequences", "update_actor", "save_checkpoint")), 1):
        assert method in line and f"restart {i} of 3" in line and "global_step_2" in line, line
        assert "rank " in line and "pid " in line and "node " in line, line
    assert "rank 1 (pid" in lines[0] and "died in generate_sequences" in lines[0]
    assert "redoing steps 3-4" in lines[1]
    assert steps_of(tmp_path)[-1]["fault/restarts"] == 3 and steps_of(tmp_path)[-1]["fault/steps_redone"] == 5
    assert sorted(p.name for p in (tmp_path / "faults").iterdir()) == sorted(f"{p}:kill" for p in faults.split(","))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["global_step_2", "global_step_4"]


@pytest.mark.slow  # waits out a 120 s call timeout
def test_a_deadlocked_rank_times_out_and_the_run_recovers(setup, reference, tmp_path: Path):
    proc = train(setup, tmp_path, "trainer.call_timeout_s=120", faults="update_actor@3:1:hang")
    assert_same_metrics(steps_of(tmp_path), reference)
    (line,) = recovery_lines(proc)
    assert "timed out in update_actor" in line and "rank 1 (pid" in line and "restart 1 of 3" in line, line


@pytest.mark.slow  # two runs
def test_without_restarts_the_cli_names_the_worker_and_the_fix_and_the_same_command_resumes(
    setup, reference, tmp_path: Path
):
    faults = "update_actor@3:0"
    args = overrides(setup, tmp_path, "trainer.max_restarts=0", *armed(tmp_path, faults))
    failed = run_cli(args, tmp_path)
    assert failed.returncode == 1, failed.stderr[-5000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow train: error: worker failure at step 3: group ") and "rank 0 (pid" in last, last
    # the dead rank's own error or its peer's gloo error may reach the controller first: both name it
    assert "died in update_actor" in last, last
    assert "; trainer.max_restarts=0. Running the same command again resumes from " in last, last
    assert "global_step_2" in last and "raise trainer.max_restarts" in last, last
    assert "Traceback" not in failed.stderr, failed.stderr[-5000:]
    again = run_cli(args, tmp_path)  # the fault fired once: this one finishes
    assert again.returncode == 0, again.stderr[-5000:]
    assert_same_metrics(steps_of(tmp_path), reference)


def _descendants(pid: int) -> list[int]:
    """Processes whose parent chain reaches `pid` (Linux /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


@pytest.mark.slow  # two runs
def test_controller_killed_mid_save_resumes_from_the_last_complete_checkpoint(setup, reference, tmp_path: Path):
    faults = "save_checkpoint@4:0:hang"  # rank 0 stays inside the step-4 save until the controller is killed
    args = overrides(setup, tmp_path, *armed(tmp_path, faults))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli.train", *args],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = tmp_path / "faults" / f"{faults}"
    deadline = time.monotonic() + 400
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists() and proc.poll() is None, "the run never reached the step-4 save"
    assert any(p.name.startswith("global_step_4.tmp-") for p in (tmp_path / "ckpt").iterdir())
    left = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # kill -9 of the controller, mid-save
    proc.wait(timeout=30)
    for pid in left:  # what the controller started (its local Ray) would die with it; make sure
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert [r["step"] for r in steps_of(tmp_path)] == [1, 2, 3]
    assert not (tmp_path / "ckpt" / "global_step_4").exists()
    again = run_cli(args, tmp_path)
    assert again.returncode == 0, again.stderr[-5000:]
    assert "resumed from " in again.stderr and "global_step_2 at step 2" in again.stderr, again.stderr[-3000:]
    assert_same_metrics(steps_of(tmp_path), reference)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["global_step_2", "global_step_4"]


@pytest.fixture
def two_nodes(monkeypatch):
    """A head and a worker node of 1 CPU each on loopback (conftest.loopback_cluster)."""
    from conftest import loopback_cluster

    yield from loopback_cluster(monkeypatch)


def _kill_the_worker_on(node_id: str, markers: list[Path], timeout_s: float = 400) -> int:
    """Once every marker exists (the ranks are parked in a hang point), SIGKILL the live worker actor on
    `node_id`; returns its pid."""
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while not all(m.exists() for m in markers):
        assert time.monotonic() < deadline, "the ranks never reached the hang point"
        time.sleep(0.5)
    (pid,) = [
        a["Pid"]
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["Address"]["NodeID"] == node_id and "Worker" in a["ActorClassName"]
    ]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow  # a 2-node cluster and a restart: ~2 min on 2 cores
def test_a_two_node_run_recovers_when_the_worker_on_the_second_node_dies(
    setup, reference, tmp_path: Path, two_nodes, monkeypatch, caplog
):
    import logging
    import threading

    from hybridflow.cli.train import load_run, run

    # both ranks park in step 3's generate; then the worker on the second node is killed from outside
    hang = armed(tmp_path, "generate_sequences@3:0:hang,generate_sequences@3:1:hang")
    monkeypatch.setenv("HYBRIDFLOW_NO_PROGRESS", "1")
    head, second = two_nodes.list_all_nodes()
    markers = [tmp_path / "faults" / f"generate_sequences@3:{rank}:hang" for rank in (0, 1)]
    killed: list[int] = []
    killer = threading.Thread(target=lambda: killed.append(_kill_the_worker_on(second.node_id, markers)), daemon=True)
    try:  # loading the run imports the fault plugin here too: it must not outlive the test
        resolved, inputs = load_run(
            None, overrides(setup, tmp_path, "trainer.nnodes=2", "trainer.n_workers_per_node=1", *hang)
        )
        killer.start()
        with caplog.at_level(logging.WARNING, logger="hybridflow"):
            run(resolved, inputs)
    finally:
        disarm()
    killer.join(timeout=5)
    assert_same_metrics(steps_of(tmp_path), reference)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker failure:")]
    assert f"(pid {killed[0]}, node {second.node_id[:8]}) died in generate_sequences" in line, line
    assert "restart 1 of 3" in line and "global_step_2" in line, line


@pytest.mark.slow  # two SFT runs
def test_sft_recovers_from_a_killed_worker_exactly(setup, tmp_path: Path):
    from test_sft_cli import sft_overrides

    def sft(tmp: Path, faults: str = "") -> tuple[subprocess.CompletedProcess, list[dict]]:
        tmp.mkdir(parents=True)
        args = ["sft", *sft_overrides(setup[0], tmp), "trainer.total_training_steps=4", "trainer.cpus_per_worker=1"]
        proc = run_cli([*args, *armed(tmp, faults)], tmp, module="hybridflow.cli.main")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc, [r for r in read_metrics(tmp) if "train/loss" in r]

    _, ref = sft(tmp_path / "reference")
    proc, got = sft(tmp_path / "faulted", faults="train_batch@4:1")  # after step 3 was logged
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for mine, theirs in zip(got, ref):
        for key in ("train/loss", "train/grad_norm", "train/tokens"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (mine["step"], key)
    (line,) = recovery_lines(proc)
    assert "died in train_batch" in line and "global_step_2, redoing steps 3-4" in line, line
