"""`hybridflow dpo` through its real CLI: tiny random Llama, real files; the Ray backend with 2 workers, and the
in-process backend with LoRA (the reference is the model with its adapters off) and reference-free IPO.

The end-to-end runs are subprocesses (real Ray actors, gloo group, FSDP2, checkpoints); the config and data
errors run the same `main` in-process, since they start no worker.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_sft_cli import run_cli

from hybridflow.cli.main import main as cli_main
from hybridflow.models import tiny_model_dir
from hybridflow.rewards.registry import default_compute_score


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(tiny_model_dir("llama"))


def dpo_overrides(model: str, tmp: Path) -> list[str]:
    """32 generated pairs, 8 per step over 2 workers, 2 pairs per micro-batch; validation on 8 pairs."""
    return [
        f"model.path={model}",
        f"data.task_dir={tmp / 'data'}",
        "data.gen_train_size=32",
        "data.gen_val_size=8",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_device=2",
        "dpo.beta=0.5",
        "optim.lr=1e-3",
        "trainer.test_freq=2",
        "trainer.save_freq=4",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        f"trainer.log_dir={tmp / 'logs'}",
        "trainer.logger=[console,jsonl]",
    ]


def _dpo(tiny_model: str, tmp: Path, steps: int, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    tmp.mkdir(parents=True, exist_ok=True)
    proc = run_cli(["dpo", *dpo_overrides(tiny_model, tmp), f"trainer.total_training_steps={steps}", *extra], tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = (tmp / "logs" / "metrics.jsonl").read_text().splitlines()
    return proc, [json.loads(line) for line in lines if line.strip()]


def _val(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")


@pytest.mark.slow  # Ray start-up and two workers: 39-192 s on 2 cores shared with other jobs
def test_dpo_on_two_ray_workers_raises_the_reward_margin(tiny_model: str, tmp_path: Path) -> None:
    proc, rows = _dpo(tiny_model, tmp_path, 4)
    margins = _val(rows, "val/rewards/margins")
    assert sorted(margins) == [0, 2, 4]
    assert margins[0] == pytest.approx(0, abs=1e-4)  # the policy starts as its reference
    assert margins[4] > margins[2] > margins[0], margins
    assert _val(rows, "val/loss")[4] < _val(rows, "val/loss")[0]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(f"train/{k}" in r for r in train for k in TRL_NAMES)
    assert all(0 <= r["train/rewards/accuracies"] <= 1 for r in train)
    assert "starting 2 workers (ray) ... done" in proc.stdout and "saving checkpoint global_step_4" in proc.stdout
    assert (tmp_path / "ckpt" / "global_step_4" / "actor").is_dir()


@pytest.mark.slow  # two in-process runs: 28-156 s on 2 shared cores
def test_local_lora_and_reference_free_runs(tiny_model: str, tmp_path: Path) -> None:
    local = ("trainer.backend=local", "trainer.n_workers_per_node=1")
    _, rows = _dpo(tiny_model, tmp_path / "lora", 2, *local, "lora.rank=4", "lora.alpha=8", "trainer.test_freq=1")
    margins = _val(rows, "val/rewards/margins")
    assert margins[0] == pytest.approx(0, abs=1e-4) and margins[2] > margins[1] > margins[0], margins
    meta = json.loads((tmp_path / "lora" / "ckpt" / "global_step_2" / "actor" / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4

    _, rows = _dpo(tiny_model, tmp_path / "free", 2, *local, "dpo.reference_free=true", "dpo.loss_type=ipo")
    chosen, logps = _val(rows, "val/rewards/chosen"), _val(rows, "val/logps/chosen")
    assert chosen[0] == pytest.approx(0.5 * logps[0], rel=1e-5)  # no reference: the reward is beta * log-prob
    losses = _val(rows, "val/loss")
    assert losses[2] < losses[0]


@pytest.mark.slow  # three in-process runs: 87-217 s on 2 shared cores
def test_resumed_run_logs_the_losses_of_an_uninterrupted_one(tiny_model: str, tmp_path: Path) -> None:
    """Also shows the reference is the initial policy after a resume, not the checkpoint's."""
    local = ("trainer.backend=local", "trainer.n_workers_per_node=1", "trainer.save_freq=2", "engine.packing=true")
    _, full = _dpo(tiny_model, tmp_path / "full", 4, *local)
    _, first = _dpo(tiny_model, tmp_path / "parts", 2, *local)
    _, resumed = _dpo(tiny_model, tmp_path / "parts", 4, *local)  # resume_mode=auto picks global_step_2
    parts = {r["step"]: r for r in first + resumed[len(first) :] if "train/loss" in r}
    assert sorted(parts) == [1, 2, 3, 4]
    for ref in (r for r in full if "train/loss" in r):
        for key in ("train/loss", "train/grad_norm", "train/rewards/margins"):
            assert parts[ref["step"]][key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (ref["step"], key)


def test_data_preference_writes_pairs(tmp_path: Path, capsys) -> None:
    args = ["data", "arithmetic", "--preference", "--out", str(tmp_path), "--train-size", "6", "--test-size", "3"]
    assert cli_main(args) == 0
    frame = pd.read_parquet(tmp_path / "arithmetic_preference_train.parquet")
    assert len(frame) == 6 and {"prompt", "chosen", "rejected"} <= set(frame.columns)
    assert (frame["chosen"] != frame["rejected"]).all()
    assert "arithmetic_preference_test.parquet" in capsys.readouterr().out
    assert cli_main([*args, "--sft"]) == 2
    assert "give one of them" in capsys.readouterr().err


@pytest.mark.slow  # loads and samples the tiny model: 8-24 s on 2 shared cores
def test_data_preference_samples_rejected_answers_from_a_model(tiny_model: str, tmp_path: Path, capsys) -> None:
    args = ["data", "arithmetic", "--preference", "--out", str(tmp_path), "--train-size", "4", "--test-size", "2"]
    assert cli_main([*args, "--rejected-model", tiny_model, "--samples", "2"]) == 0
    assert "arithmetic_preference_train.parquet: rejected answers sampled 4, by rule 0" in capsys.readouterr().out
    frame = pd.read_parquet(tmp_path / "arithmetic_preference_train.parquet")
    assert (frame["rejected_source"] == "sampled").all()  # a random model's text never holds the right number
    for _, row in frame.iterrows():
        assert row["rejected"].strip() and default_compute_score("arithmetic", row["rejected"], row["chosen"]) == 0
    assert cli_main(["data", "arithmetic", "--out", str(tmp_path), "--rejected-model", tiny_model]) == 2
    assert "add --preference" in capsys.readouterr().err


def test_print_config_resolves_and_starts_nothing(tiny_model: str, tmp_path: Path, capsys) -> None:
    args = dpo_overrides(tiny_model, tmp_path) + ["trainer.total_training_steps=null", "dpo.loss_type=hinge"]
    assert cli_main(["dpo", "--print-config", *args]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["total_training_steps"] == 4 and printed["optim"]["total_training_steps"] == 4
    assert printed["dpo"] == {"loss_type": "hinge", "beta": 0.5, "label_smoothing": 0.0, "reference_free": False}
    assert printed["engine"]["fsdp_size"] == 1
    assert not (tmp_path / "ckpt").exists()


def test_list_keys_names_the_dpo_section(capsys) -> None:
    assert cli_main(["dpo", "--list-keys", "dpo"]) == 0
    out = capsys.readouterr().out
    assert "dpo.beta" in out and "dpo.label_smoothing" in out and "dpo.reference_free" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["dpo.beta=0"], "dpo.beta must be > 0"),
        (["dpo.loss_type=kto"], "dpo.loss_type='kto' is not a registered preference loss"),
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "does not apply to dpo.loss_type=ipo"),
        (["data.invalid_pairs=skip"], r"data.invalid_pairs must be one of \['drop', 'error'\]"),
        (["data.chosen_key=good"], r"column\(s\) \['good'\] missing.*data.chosen_key"),
        (["data.max_length=8"], "exceed data.max_length=8.*data.truncation"),
        (["data.task=countdown"], "no rule for a wrong answer"),
        (["data.train_batch_size=7"], "must divide evenly over 2 workers"),
        (["trainer.placement=split"], "unknown config key .trainer.placement."),
        (["engine.tensor_parallel_size=2"], "DPO runs data parallel only"),
    ],
)
def test_bad_inputs_fail_with_one_line(tiny_model: str, tmp_path: Path, capsys, extra, message) -> None:
    assert cli_main(["dpo", *dpo_overrides(tiny_model, tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridflow dpo: error:"), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "ckpt").exists()


def test_invalid_pairs_error_refuses_the_file_naming_the_row(tiny_model: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "pairs.parquet"
    rows = [{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}] * 8 + [
        {"prompt": "What is 1 + 2?", "chosen": "3", "rejected": "3"}
    ]
    pd.DataFrame(rows).to_parquet(path, index=False)
    args = [*dpo_overrides(tiny_model, tmp_path), f"data.train_files={path}", "data.invalid_pairs=error"]
    assert cli_main(["dpo", "--print-config", *args]) == 2
    assert re.search(r"pairs.parquet: row 8: identical chosen and rejected", capsys.readouterr().err)
    assert cli_main(["dpo", "--print-config", *args[:-1]]) == 0  # the default drops it
