"""`--print-config` prints only YAML on stdout (every message goes to stderr), through a pipe, and what it
prints loads back as the same run: `hybridflow train --print-config ARGS | hybridflow train --config /dev/stdin
--print-config` prints the identical YAML for every layout option, auto ones included (measured once: the
printed values are concrete, so loading them back measures nothing). The same for `hybridflow sft`."""

from __future__ import annotations

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
        [sys.executable, "-m", "hybridflow.trainer.cli", *args],
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
def test_train_print_config_round_trips_through_a_pipe(tmp_path: Path, device_profile: Path, layout: list[str]):
    args = [*base_overrides(str(tiny_model_dir("llama")), tmp_path), "algorithm.adv_estimator=gae"]
    printed, stderr = round_trip("train", [*args, f"trainer.device_profile={device_profile}", *layout], tmp_path)
    t = printed["trainer"]
    assert isinstance(t["n_workers_per_node"], int) and t["placement"] in ("colocate", "split")
    assert printed["actor"]["engine"]["param_dtype"] in ("fp32", "bf16")
    if "trainer.n_workers_per_node=null" in layout:
        assert "trainer.n_workers_per_node=null -> " in stderr  # the planner's choice, on stderr
    if "trainer.placement=auto" in layout:
        assert "trainer.placement=auto -> " in stderr
    assert not (tmp_path / "ckpt").exists()


def test_sft_print_config_round_trips_through_a_pipe(tmp_path: Path):
    printed, _ = round_trip("sft", sft_overrides(str(tiny_model_dir("llama")), tmp_path), tmp_path)
    assert printed["engine"]["param_dtype"] in ("fp32", "bf16") and printed["trainer"]["cpus_per_worker"] >= 1
