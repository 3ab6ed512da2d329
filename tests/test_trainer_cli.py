"""Smoke runs of `hybridflow train` through its real CLI: a tiny random model, 2 steps each.

Every run is a real subprocess with real Ray workers (or the in-process backend), a
real gloo process group, real generation, scoring and FSDP2 updates; the assertions
read the metrics file the run wrote and its console (phase lines, no library progress bars).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.models import tiny_model_dir


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(tiny_model_dir("llama"))


def base_overrides(model: str, tmp: Path) -> list[str]:
    """A run small enough for 2 CPU cores: 4 prompts x 2 samples, 8 new tokens, 2 workers."""
    return [
        f"model.path={model}",
        f"data.task_dir={tmp / 'data'}",
        "data.gen_train_size=16",
        "data.gen_val_size=4",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "data.max_prompt_length=128",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_device=2",
        "critic.ppo_mini_batch_size=2",
        "critic.ppo_micro_batch_size_per_device=2",
        "rollout.n=2",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        f"trainer.log_dir={tmp / 'logs'}",
        "trainer.logger=[console,jsonl]",
    ]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run: no inherited torch.distributed variables, no bars, plus `extra`."""
    dist_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(HYBRIDFLOW_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: int = 420,
    module: str = "hybridflow.cli.train",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`python -m module args...` as a user would run it (`cli_env`, plus `env`)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=cli_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(tmp: Path) -> list[dict]:
    lines = (tmp / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


LIBRARY_BARS = ("Loading weights", "it/s]")
"""What transformers' weight-loading bar prints, and any tqdm bar's rate."""


def assert_console(proc: subprocess.CompletedProcess, extra: list[str]) -> None:
    """One line per phase on stdout; the workers' library bars only with trainer.verbose=true."""
    if "trainer.verbose=true" in extra:  # forwarded by Ray from the workers; the controller loads no weights
        assert "Loading weights" in proc.stderr and "ActorRolloutRefWorker pid=" in proc.stderr, proc.stderr[-3000:]
    else:
        for bar in LIBRARY_BARS:
            assert bar not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    n = next((e.split("=")[1] for e in extra if e.startswith("trainer.n_workers_per_node=")), "2")
    workers = "1 worker (local)" if "trainer.backend=local" in extra else f"{n} workers (ray)"
    phases = [f"starting {workers}", "loading models", "validating (4 prompts)"]
    if "trainer.save_freq=2" in extra:
        phases.append("saving checkpoint global_step_2 in ")
    lines = proc.stdout.splitlines()
    for start in phases:
        assert any(line.startswith(start) and " ... done in " in line for line in lines), (start, proc.stdout[-3000:])


def train_ok(tiny_model: str, tmp_path: Path, *extra: str) -> list[dict]:
    proc = run_cli(base_overrides(tiny_model, tmp_path) + list(extra), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert_console(proc, list(extra))
    records = read_metrics(tmp_path)
    steps = [r for r in records if r["step"] >= 1 and "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2], records
    for r in steps:
        assert r["response_length/mean"] > 0
        assert "critic/score/mean" in r and "timing_s/gen" in r
        assert r["parity/token_mismatch_rows"] == 0 and r["parity/token_checked_rows"] > 0  # the guard ran
        assert r["parity/weight_findings"] == 0 and "timing_s/parity" in r
    assert any(k.startswith("val-core/") for k in records[-1]), records[-1]
    profile = json.loads((tmp_path / "logs" / "profile.json").read_text())  # end-of-run profile table
    assert {p["metric"]: p["steps"] for p in profile}["timing_s/gen"] == 2, profile
    assert "| actor_rollout | generate | 2 |" in (tmp_path / "logs" / "profile.md").read_text()
    return steps


@pytest.mark.parametrize(
    "name, extra, expect",
    [
        # both KL terms in one run (a full-weight reference engine; old log-probs recomputed for the reward)
        (
            "grpo_kl_verbose_save",
            [
                "actor.use_kl_loss=true",
                "actor.kl_loss_coef=0.1",
                "algorithm.use_kl_in_reward=true",
                "trainer.verbose=true",
                "trainer.save_freq=2",
            ],
            ["actor/kl_loss", "actor/reward_kl_penalty"],
        ),
        # Same CLI path as grpo with another estimator (whose math has hand-computed tests), or (gae) as
        # "split" below minus the placement, or (remax) with one more greedy generate per step: kept out of the
        # default run so the suite stays under 15 minutes.
        pytest.param(
            "gae", ["algorithm.adv_estimator=gae"], ["critic/vf_loss", "critic/values/mean"], marks=pytest.mark.slow
        ),
        pytest.param("reinforce_pp", ["algorithm.adv_estimator=reinforce_plus_plus"], [], marks=pytest.mark.slow),
        pytest.param("rloo", ["algorithm.adv_estimator=rloo"], [], marks=pytest.mark.slow),
        pytest.param("remax", ["algorithm.adv_estimator=remax"], ["timing_s/reward"], marks=pytest.mark.slow),
        # LoRA also trains end to end in the default run in test_sft_cli.py (SFT adapters, exported)
        pytest.param(
            "lora_kl_save",
            [
                "actor.lora.rank=8",
                "actor.lora.alpha=16",
                "actor.use_kl_loss=true",
                "actor.optim.lr=1e-3",
                "trainer.save_freq=2",
            ],
            ["actor/kl_loss", "timing_s/weight_sync"],
            marks=pytest.mark.slow,
        ),
        ("split", ["algorithm.adv_estimator=gae", "trainer.placement=split"], ["critic/vf_loss", "critic/values/mean"]),
        # the local backend also trains end to end in the default run in test_agent_cli.py and test_verl_keys.py
        pytest.param("local", ["trainer.backend=local", "trainer.n_workers_per_node=1"], [], marks=pytest.mark.slow),
        # tensor parallel over both workers for actor, reference, critic and rollout (N-D dispatch: one dp group)
        pytest.param(
            "tp2",
            [
                "actor.engine.tensor_parallel_size=2",
                "critic.engine.tensor_parallel_size=2",
                "rollout.tensor_model_parallel_size=2",
                "algorithm.adv_estimator=gae",
                "actor.use_kl_loss=true",
                "trainer.save_freq=2",
            ],
            ["critic/vf_loss", "actor/kl_loss"],
            marks=pytest.mark.slow,
        ),
        # FSDP-sharded actor (dp4) -> tp2 x dp2 rollout holding only its shard, tp groups {0,2}, {1,3}: the weight
        # sync reshards (engine/reshard.py)
        pytest.param(
            "reshard",
            ["actor.engine.fsdp_size=-1", "rollout.tensor_model_parallel_size=2", "trainer.n_workers_per_node=4"],
            ["timing_s/weight_sync"],
            marks=pytest.mark.slow,
        ),
        # Ulysses sequence parallel over both workers for actor, reference and critic (one dp group)
        pytest.param(
            "sp2",
            [
                "actor.engine.ulysses_sequence_parallel_size=2",
                "critic.engine.ulysses_sequence_parallel_size=2",
                "algorithm.adv_estimator=gae",
                "actor.use_kl_loss=true",
                "trainer.save_freq=2",
            ],
            ["critic/vf_loss", "actor/kl_loss"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "sp2_lora",
            [
                "actor.engine.ulysses_sequence_parallel_size=2",
                "actor.lora.rank=8",
                "actor.lora.alpha=16",
                "actor.use_kl_loss=true",
                "actor.optim.lr=1e-3",
            ],
            ["actor/kl_loss", "timing_s/weight_sync"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_train_smoke(tiny_model: str, tmp_path: Path, name: str, extra: list[str], expect: list[str]) -> None:
    steps = train_ok(tiny_model, tmp_path, *extra)
    for key in expect:
        assert key in steps[-1], (key, sorted(steps[-1]))


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="dp", marks=pytest.mark.slow),  # CI runs it with the slow tests
        # the reward model and the actor split every micro-batch's tokens over both workers (Ulysses)
        pytest.param(
            ["reward_model.ulysses_sequence_parallel_size=2", "actor.engine.ulysses_sequence_parallel_size=2"],
            id="sp2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_train_with_a_reward_model(tiny_model: str, tmp_path: Path, extra: list[str]) -> None:
    from tests.test_reward_model import _llama_reward_model_dir

    rm_dir = _llama_reward_model_dir(tmp_path / "rm")
    steps = train_ok(tiny_model, tmp_path, "reward_model.enable=true", f"reward_model.model.path={rm_dir}", *extra)
    for r in steps:  # the seeded head scores far from 0, and its score is part of critic/score
        assert abs(r["reward_model/score/mean"]) > 1e-3
        rule_mean = r["critic/score/mean"] - r["reward_model/score/mean"]  # arithmetic scores lie in [0, 1]
        assert -1e-5 <= rule_mean <= 1 + 1e-5


def test_bad_inputs_fail_cleanly(tiny_model: str, tmp_path: Path, capsys, monkeypatch) -> None:
    """Exit status 2, one error line last on stderr, no traceback, nothing written. The last case runs through the
    real CLI (a subprocess); the others through the same `main` in-process, since they stop before any worker."""
    from hybridflow.cli.train import main as train_main

    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_text("not a parquet file")
    cases = {
        "model path": ["model.path=/nonexistent/model"],
        "parquet": [f"data.train_files=[{bad_parquet}]"],
        "batch sizes": ["data.train_batch_size=3"],
        "estimator": ["algorithm.adv_estimator=nope"],
        "unwritable checkpoints": [f"trainer.default_local_dir={bad_parquet}/ckpt", "trainer.save_freq=1"],
    }
    monkeypatch.chdir(tmp_path)
    for what, extra in cases.items():
        args = base_overrides(tiny_model, tmp_path) + extra
        if what == "unwritable checkpoints":
            proc = run_cli(args, tmp_path, timeout=120)
            code, stderr = proc.returncode, proc.stderr
        else:
            code, stderr = train_main(args), capsys.readouterr().err
        assert code == 2, (what, stderr[-2000:])
        err = stderr.strip().splitlines()
        assert err and err[-1].startswith("hybridflow train: error:"), (what, stderr[-2000:])
        assert "Traceback" not in stderr, (what, stderr[-2000:])
        assert not (tmp_path / "ckpt").exists(), what


def test_print_config_shows_the_resolved_run_and_starts_nothing(
    tiny_model: str, tmp_path: Path, capsys, monkeypatch
) -> None:
    """In-process (`main`, as `python -m hybridflow.cli.train` runs it): the pipe through a real subprocess
    is tests/test_print_config.py's."""
    from hybridflow.cli.train import main as train_main

    args = [
        a
        for a in base_overrides(tiny_model, tmp_path)
        if not a.startswith(("trainer.default_local_dir", "trainer.log_dir"))
    ]
    monkeypatch.chdir(tmp_path)
    code = train_main(
        [
            "--print-config",
            *args,
            "trainer.experiment_name=b",
            "trainer.n_workers_per_node=1",
            "trainer.total_training_steps=null",
            "trainer.total_epochs=2",
        ]
    )
    proc = capsys.readouterr()
    assert code == 0, proc.err[-3000:]
    printed = yaml.safe_load(proc.out)
    t = printed["trainer"]
    assert t["default_local_dir"] == "checkpoints/hybridflow/b" and t["log_dir"] == "outputs/hybridflow/b"
    assert t["cpus_per_worker"] == (os.cpu_count() or 1)
    assert t["total_training_steps"] == 2 * 16 // 4 and printed["actor"]["optim"]["total_training_steps"] == 8
    assert printed["rollout"]["response_length"] == 8
    assert "# resolved plan:" in proc.out and "steps_per_epoch: 4" in proc.out
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "outputs").exists()
    saved = tmp_path / "resolved.yaml"
    saved.write_text(proc.out)
    code = train_main(["--print-config", "--config", str(saved)])
    again = capsys.readouterr()
    assert code == 0, again.err[-3000:]
    assert again.out == proc.out  # the printed run loads back as the same run
