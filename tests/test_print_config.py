"""`--print-config` prints only YAML on stdout (every message goes to stderr), through a pipe, and what it
prints loads back as the same run: `hybridflow train --print-config ARGS | hybridflow train --config /dev/stdin
--print-config` prints the identical YAML for every layout option, auto ones included (measured once: the
printed values are concrete, so loading them back measures nothing). The same for `hybridflow sft`.

The pipe runs are real subprocesses: `hybridflow sft`, and `hybridflow train` with the layout that leaves the most
to the planner (its choices logged on stderr). The other layouts run the same `main` in-process (print, then load
the printed file back), where anything but YAML on stdout fails the same checks."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.models import tiny_model_dir
from hybridflow.planner.device import DevicePoint, DeviceProfile
from tests.test_sft_cli import sft_overrides
from tests.test_trainer_cli import base_overrides, cli_env


def cli(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`hybridflow args...` with stdout and stderr pipes (and `stdin` on a pipe)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", *args],
        cwd=cwd,
        env=cli_env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def round_trip(command: str, args: list[str], cwd: Path) -> tuple[dict, str]:
    """Print the resolved run, pipe it back through `--config /dev/stdin`; (the printed YAML, the first stderr)."""
    first = cli([command, "--print-config", *args], cwd)
    printed = yaml.safe_load(first.stdout)  # nothing but YAML on stdout
    again = cli([command, "--config", "/dev/stdin", "--print-config"], cwd, stdin=first.stdout)
    assert again.stdout == first.stdout
    return printed, first.stderr


def round_trip_in_process(command: str, args: list[str], cwd: Path, capsys, caplog) -> tuple[dict, str]:
    """`round_trip` through the same `main` in this process, the printed YAML loaded back from a file;
    (the printed YAML, what the first call logged)."""
    from hybridflow.cli.main import main

    caplog.set_level(logging.INFO, logger="hybridflow")
    assert main([command, "--print-config", *args]) == 0
    first = capsys.readouterr().out
    printed = yaml.safe_load(first)  # nothing but YAML on stdout
    logged = caplog.text
    saved = cwd / "printed.yaml"
    saved.write_text(first)
    assert main([command, "--config", str(saved), "--print-config"]) == 0
    assert capsys.readouterr().out == first
    return printed, logged


@pytest.fixture(scope="module")
def device_profile(tmp_path_factory) -> Path:
    """A 1-thread profile (every thread count falls back to it): the planner's choice without measuring."""
    path = tmp_path_factory.mktemp("profile") / "device.json"
    DeviceProfile("m", "float32", [DevicePoint(1, 8, 64, 0.01, 0.03, 0.05)]).save(path)
    return path


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["trainer.n_workers_per_node=null", "trainer.placement=auto"],
        ["trainer.placement=auto"],
        ["trainer.placement=split"],
    ],
    ids=["default", "null-workers", "auto-placement", "split"],
)
def test_train_print_config_round_trips_for_every_layout(
    tmp_path: Path, device_profile: Path, layout: list[str], capsys, caplog, monkeypatch
):
    args = [*base_overrides(str(tiny_model_dir("llama")), tmp_path), "algorithm.adv_estimator=gae"]
    args += [f"trainer.device_profile={device_profile}", *layout]
    if "trainer.n_workers_per_node=null" in layout:
        printed, messages = round_trip("train", args, tmp_path)  # through a pipe: the messages are its stderr
    else:
        monkeypatch.chdir(tmp_path)
        printed, messages = round_trip_in_process("train", args, tmp_path, capsys, caplog)
    t = printed["trainer"]
    assert isinstance(t["n_workers_per_node"], int) and t["placement"] in ("colocate", "split")
    assert printed["actor"]["engine"]["param_dtype"] in ("fp32", "bf16")
    if "trainer.n_workers_per_node=null" in layout:
        assert "trainer.n_workers_per_node=null -> " in messages  # the planner's choice, on stderr
    if "trainer.placement=auto" in layout:
        assert "trainer.placement=auto -> " in messages
    assert not (tmp_path / "ckpt").exists()


def test_sft_print_config_round_trips_through_a_pipe(tmp_path: Path):
    printed, _ = round_trip("sft", sft_overrides(str(tiny_model_dir("llama")), tmp_path), tmp_path)
    assert printed["engine"]["param_dtype"] in ("fp32", "bf16") and printed["trainer"]["cpus_per_worker"] >= 1
