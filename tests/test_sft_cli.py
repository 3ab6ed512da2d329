"""`hybridflow sft` through its real CLI: tiny random Llama, Ray backend with 2 workers, real files.

The end-to-end runs are subprocesses (real Ray actors, gloo group, FSDP2, checkpoints);
the config and data errors, and the LoRA test's exports, run the same `main` in-process, since they start no
worker (the Ray test runs the real `hybridflow export`).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_trainer_cli import run_cli as run_trainer_cli

from hybridflow.cli.main import main as cli_main
from hybridflow.models import tiny_model_dir


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(tiny_model_dir("llama"))


def sft_overrides(model: str, tmp: Path) -> list[str]:
    """32 generated examples, 8 per step over 2 workers, micro-batches of 2 (uneven last one per rank: 4 = 2+2)."""
    return [
        f"model.path={model}",
        f"data.task_dir={tmp / 'data'}",
        "data.gen_train_size=32",
        "data.gen_val_size=6",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_device=2",
        "optim.lr=1e-3",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        f"trainer.log_dir={tmp / 'logs'}",
        "trainer.logger=[console,jsonl]",
    ]


def run_cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m hybridflow.cli.main args...` (the `hybridflow` command)."""
    return run_trainer_cli(args, cwd, timeout, module="hybridflow.cli.main")


def _sft(tiny_model: str, tmp: Path, steps: int, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    tmp.mkdir(parents=True, exist_ok=True)
    proc = run_cli(["sft", *sft_overrides(tiny_model, tmp), f"trainer.total_training_steps={steps}", *extra], tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = (tmp / "logs" / "metrics.jsonl").read_text().splitlines()
    return proc, [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow  # ~35 s of Ray start-up and two workers
def test_sft_on_two_ray_workers_logs_losses_and_exports(tiny_model: str, tmp_path: Path) -> None:
    proc, full = _sft(tiny_model, tmp_path, 4)
    losses = {r["step"]: r["train/loss"] for r in full if "train/loss" in r}
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert [r["step"] for r in full if "val/loss" in r] == [2, 4]
    assert all(r["train/tokens_per_s"] > 0 and r["train/lr"] == 1e-3 for r in full if "train/loss" in r)
    assert "starting 2 workers (ray) ... done" in proc.stdout and "saving checkpoint global_step_4" in proc.stdout
    assert (tmp_path / "logs" / "run.png").is_file()
    export = run_cli(["export", str(tmp_path / "ckpt" / "global_step_4"), "--out", str(tmp_path / "hf")], tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer_config.json").is_file()


@pytest.mark.slow  # three runs; the default run resumes a PPO run (test_fault_tolerance.py)
def test_resumed_run_logs_the_losses_of_an_uninterrupted_one(tiny_model: str, tmp_path: Path) -> None:
    local = (
        "trainer.backend=local",
        "trainer.n_workers_per_node=1",
        "data.packing=true",
    )  # in-process: no Ray start-up
    _, full = _sft(tiny_model, tmp_path / "full", 4, *local)
    _, first = _sft(tiny_model, tmp_path / "parts", 2, *local)
    _, resumed = _sft(tiny_model, tmp_path / "parts", 4, *local)  # resume_mode=auto picks global_step_2
    parts = {r["step"]: r for r in first + resumed[len(first) :] if "train/loss" in r}
    assert sorted(parts) == [1, 2, 3, 4]
    for ref in (r for r in full if "train/loss" in r):
        for key in ("train/loss", "train/grad_norm"):
            assert parts[ref["step"]][key] == pytest.approx(ref[key], rel=1e-6), (ref["step"], key)


def test_data_sft_writes_readable_parquet(tmp_path: Path, capsys) -> None:
    assert (
        cli_main(["data", "arithmetic", "--sft", "--out", str(tmp_path), "--train-size", "6", "--test-size", "3"]) == 0
    )
    frame = pd.read_parquet(tmp_path / "arithmetic_sft_train.parquet")
    assert len(frame) == 6 and {"prompt", "response", "messages"} <= set(frame.columns)
    assert "arithmetic_sft_test.parquet" in capsys.readouterr().out


def test_print_config_resolves_and_starts_nothing(tiny_model: str, tmp_path: Path, capsys) -> None:
    args = sft_overrides(tiny_model, tmp_path) + ["data.packing=true", "trainer.total_training_steps=null"]
    assert cli_main(["sft", "--print-config", *args]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["total_training_steps"] == 4 and printed["optim"]["total_training_steps"] == 4
    assert printed["engine"]["packing"] is True and printed["engine"]["fsdp_size"] == 1
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["data.prompt_key=question"], r"column\(s\) \['question'\] missing.*data.prompt_key"),
        (["data.max_lenght=64"], "unknown config key 'data.max_lenght'; did you mean \\['data.max_length'\\]"),
        (["data.max_length=8"], "exceed data.max_length=8.*data.truncation"),
        (["trainer.placement=split"], "unknown config key .trainer.placement."),
        (["data.task=countdown"], "no known correct response"),
        (["data.train_batch_size=7"], "must divide evenly over 2 workers"),
        (["engine.fsdp_size=3"], r"error: engine.fsdp_size=3 must divide the number of ranks \(2\)"),
    ],
)
def test_bad_inputs_fail_with_one_line(tiny_model: str, tmp_path: Path, capsys, extra, message) -> None:
    assert cli_main(["sft", *sft_overrides(tiny_model, tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridflow sft: error:"), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "ckpt").exists()


def test_sft_with_lora_trains_adapters_and_exports_them(tiny_model: str, tmp_path: Path, capsys) -> None:
    local = ("trainer.backend=local", "trainer.n_workers_per_node=1", "lora.rank=4", "lora.alpha=8")
    _, rows = _sft(tiny_model, tmp_path, 2, *local)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 2 and losses[1] < losses[0]
    ckpt = tmp_path / "ckpt" / "global_step_2"
    meta = json.loads((ckpt / "actor" / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4
    for extra, expect in (([], "model.safetensors"), (["--adapter"], "adapter_model.safetensors")):
        out = tmp_path / f"export{len(extra)}"  # in-process: the real `hybridflow export` runs in the Ray test above
        assert cli_main(["export", str(ckpt), "--out", str(out), *extra]) == 0, capsys.readouterr().err[-3000:]
        assert (out / expect).is_file()
