"""`hybridflow data / export / generate` through the installed console script, on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.cli.args import ROLLOUT_NAMES as CLI_ROLLOUT_NAMES
from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.models import tiny_model_dir
from hybridflow.rollout.config import ROLLOUT_NAMES
from tests.engine_helpers import make_batch

SCRIPT = Path(sys.executable).parent / "hybridflow"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    dist_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess, command: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hybridflow {command}: error:") or last.startswith("hybridflow: error:"), last
    return last


def test_console_script_is_installed():
    assert SCRIPT.exists(), f"{SCRIPT} missing: install hybridflow (pip install -e .)"


@pytest.mark.parametrize("order", ["knobs_last", "knobs_first"])
def test_data_writes_verl_parquet_with_difficulty_knobs(tmp_path: Path, order: str):
    options = ["--out", str(tmp_path / "d"), "--train-size", "6", "--test-size", "3", "--seed", "1"]
    knobs = ["max_digits=1", "num_operands=2"]
    args = options + knobs if order == "knobs_last" else knobs + options
    proc = cli("data", "arithmetic", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    train = pd.read_parquet(tmp_path / "d" / "arithmetic_train.parquet")
    test = pd.read_parquet(tmp_path / "d" / "arithmetic_test.parquet")
    assert len(train) == 6 and len(test) == 3
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(train.columns)
    answers = [abs(int(r["ground_truth"])) for r in train["reward_model"]]
    # two one-digit operands: no answer reaches 100 (at most 9 * 9 = 81)
    assert max(answers) < 100, answers


@pytest.mark.parametrize(
    "args, message",
    [
        (["arithmetic", "--out", "OUT", "digits=1"], "no difficulty setting 'digits'"),
        (["sudoku", "--out", "OUT"], "sudoku"),
        (["arithmetic", "--out", "OUT", "--bogus", "3"], "unrecognized arguments: --bogus"),
    ],
)
def test_data_bad_input_is_one_clear_error(tmp_path: Path, args: list[str], message: str):
    proc = cli("data", *[str(tmp_path / "d") if a == "OUT" else a for a in args], cwd=tmp_path)
    assert message in one_line_error(proc, "data")
    assert not list(tmp_path.glob("d/*.parquet"))


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded checkpoint of the tiny Llama after one update, and its full weights."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "global_step_1"
    engine = FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig(param_dtype="fp32"), OptimConfig(lr=1e-2))
    engine.train_step([make_batch(2, 5, 4, seed=3)], lambda out, micro: (-out["log_probs"].sum(), {}))
    engine.save_checkpoint(ckpt)
    return ckpt, engine.full_state_dict()


def test_export_writes_a_loadable_hf_directory_with_the_trained_weights(tmp_path: Path, trained_checkpoint):
    ckpt, weights = trained_checkpoint
    proc = cli(
        "export", str(ckpt), "--out", str(tmp_path / "hf"), "--tokenizer", str(tiny_model_dir("llama")), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    loaded = model.state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(loaded[name], tensor)
    assert (tmp_path / "hf" / "tokenizer_config.json").exists()


def test_export_of_a_missing_checkpoint_is_one_clear_error(tmp_path: Path):
    proc = cli("export", str(tmp_path / "nope"), "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert "does not exist" in one_line_error(proc, "export")
    assert not (tmp_path / "hf").exists()


def test_generate_scores_every_prompt_of_an_exported_checkpoint(tmp_path: Path, trained_checkpoint):
    ckpt, _ = trained_checkpoint
    assert (
        cli(
            "data", "arithmetic", "--out", str(tmp_path / "d"), "--train-size", "2", "--test-size", "5", cwd=tmp_path
        ).returncode
        == 0
    )
    data = tmp_path / "d" / "arithmetic_test.parquet"
    out = tmp_path / "gen.jsonl"
    # A bare checkpoint has no trainer_state.json naming the model: export needs the tokenizer from there.
    hf = tmp_path / "hf"
    assert (
        cli("export", str(ckpt), "--out", str(hf), "--tokenizer", str(tiny_model_dir("llama")), cwd=tmp_path).returncode
        == 0
    )
    proc = cli(
        "generate",
        "--model",
        str(hf),
        "--data",
        str(data),
        "--n",
        "2",
        "--max-response-length",
        "4",
        "--batch-size",
        "3",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and {r["uid"] for r in rows} == {str(i) for i in range(5)}
    assert all(r["score"] in (0.0, 1.0) for r in rows)
    printed = dict(line.split(": ") for line in proc.stdout.strip().splitlines() if ": " in line)
    mean_key = next(k for k in printed if k.endswith("mean@2"))
    assert float(printed[mean_key]) == pytest.approx(sum(r["score"] for r in rows) / 10, abs=1e-4)


@pytest.mark.parametrize(
    "args",
    [["--help"], ["train", "--help"], ["sft", "--help"], ["generate", "--help"], ["train", "--list-keys", "actor"]],
)
def test_help_imports_no_torch_transformers_or_ray(args: list[str]):
    """The dispatcher and the train/sft parsers are light (cli/args.py); each subcommand imports its
    implementation only when it runs; --list-keys reads the generated key table (cli/list_keys.py)."""
    code = (
        "import contextlib, io, sys\n"
        "from hybridflow.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({args!r})\n"
        "print(sorted({'torch', 'transformers', 'ray'} & set(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_cli_rollout_names_match_the_rollout_config():
    assert CLI_ROLLOUT_NAMES == ROLLOUT_NAMES
