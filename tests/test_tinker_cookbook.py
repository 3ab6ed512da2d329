"""tinker-cookbook's recipes against `hybridflow tinker` on the embedded default model (SmolLM2-135M-Instruct),
a few steps each, each with a learning check on the metrics the cookbook itself logs (LOG_PATH/metrics.jsonl).

The service runs as `hybridflow tinker` in its own process, as a user starts it; each recipe runs as its own
process too, the two command-line recipes exactly as the cookbook's README runs them (`python -m
tinker_cookbook.recipes...`), DPO and distillation through examples/tinker_cookbook/ (the cookbook's own
command lines for those only name hub datasets). Everything is offline: the cookbook loads the tokenizer from
the model directory the service names its base model by, and `qwen3_instruct` renders SmolLM2's ChatML.

Marked `cookbook`: they need tinker-cookbook, which lives in .venv-cookbook (`./scripts/setup.sh --cookbook`;
run with `.venv-cookbook/bin/python -m pytest -m cookbook`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# on a 2-core host shared with other jobs one recipe took over 10 min (chat_sl, 2026-11-29)
pytestmark = [pytest.mark.cookbook, pytest.mark.timeout(1800)]
pytest.importorskip("tinker_cookbook")

KEY = "tml-cookbook-test"
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "tinker_cookbook"
RECIPE_TIMEOUT_S = 1500
CONVERSATIONS = [
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Name a primary colour.", "Red is a primary colour."),
    ("What do bees make?", "Bees make honey."),
    ("How many days are in a week?", "A week has seven days."),
]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`hybridflow tinker` serving the embedded default: (its URL, the base model's name = its directory)."""
    state = tmp_path_factory.mktemp("tinker-state")
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "tinker", "--api-key", KEY, "--max-tokens", "64"]
    proc = subprocess.Popen(
        [*cmd, "--state-dir", str(state)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving Tinker API at "), f"hybridflow tinker did not start: {line!r}"
        url, model = line.split()[4], line.split("base_model=")[1].strip()
        yield url, model
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(args: list[str], log_path: Path) -> list[dict]:
    """Run a recipe process against the service; the per-step metrics it logged."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def series(metrics: list[dict], key: str) -> list[float]:
    values = [m[key] for m in metrics if key in m]
    assert values, f"no {key!r} in the metrics: {sorted(metrics[0]) if metrics else 'none logged'}"
    return values


def test_the_recipes_run_without_tml_renderers():
    # tinker-cookbook 0.6.1 declares tml-renderers>=0.4.1, which the package index lacks; setup.sh leaves it out
    # because the HF-tokenizer path never imports it. The recipes below passing with it absent is that claim.
    assert importlib.util.find_spec("tml_renderers") is None


def test_chat_sl_recipe_lowers_the_nll(service, tmp_path):
    url, model = service
    data = tmp_path / "conversations.jsonl"
    with data.open("w") as f:
        for q, a in CONVERSATIONS:
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
            f.write("\n")
    log = tmp_path / "run"
    metrics = run(
        [
            "-m",
            "tinker_cookbook.recipes.chat_sl.train",
            f"model_name={model}",
            "renderer_name=qwen3_instruct",
            f"dataset={data}",
            f"base_url={url}",
            f"log_path={log}",
            f"batch_size={len(CONVERSATIONS)}",  # one batch: each epoch trains on the same rows
            "num_epochs=4",
            "learning_rate=1e-3",
            "lr_schedule=constant",
            "lora_rank=8",
            "max_length=128",
            "save_every=0",
            "eval_every=0",
            "behavior_if_log_dir_exists=delete",
        ],
        log,
    )
    nll = series(metrics, "train_mean_nll")
    assert len(nll) == 4, nll
    assert nll[-1] < 0.7 * nll[0], nll


def test_math_rl_arithmetic_raises_the_reward(service, tmp_path):
    url, model = service
    log = tmp_path / "run"
    metrics = run(
        [
            "-m",
            "tinker_cookbook.recipes.math_rl.train",
            f"model_name={model}",
            "renderer_name=qwen3_instruct",
            "env=arithmetic",
            "loss_fn=importance_sampling",
            "group_size=4",
            "groups_per_batch=4",
            "max_tokens=5",
            "learning_rate=1e-3",
            "lora_rank=8",
            "max_steps=4",
            f"base_url={url}",
            f"log_path={log}",
            "eval_every=0",
            "save_every=0",
            "behavior_if_log_dir_exists=delete",
        ],
        log,
    )
    reward = series(metrics, "env/all/reward/total")
    assert len(reward) == 4, reward
    # the base model often runs past the 5 tokens without <|im_end|> (reward -0.1, the format penalty) and never
    # adds right; stopping on time is what 4 steps of 16 samples learn
    assert sum(reward[-2:]) / 2 > reward[0], reward


def test_dpo_raises_the_chosen_vs_rejected_margin(service, tmp_path):
    url, model = service
    log = tmp_path / "run"
    metrics = run(
        [str(EXAMPLES / "dpo.py"), "--base-url", url, "--model", model, "--log-path", str(log), "--steps", "3"],
        log,
    )
    margin = series(metrics, "margin")
    assert len(margin) == 3, margin
    assert abs(margin[0]) < 1e-3, margin  # step 0: the policy is the reference
    assert margin[-1] > margin[0] + 0.05, margin


def test_on_policy_distillation_lowers_the_teacher_kl(service, tmp_path):
    url, model = service
    log = tmp_path / "run"
    metrics = run(
        [
            *(str(EXAMPLES / "distill.py"), "--base-url", url, "--model", model, "--log-path", str(log)),
            *("--steps", "4", "--groups-per-batch", "8", "--group-size", "4"),
        ],
        log,
    )
    kl = series(metrics, "teacher_kl")
    assert len(kl) == 4, kl
    # a step's KL is a 32-sample estimate and may rise once: a teacher trained for 6 steps on "Blue." to every
    # prompt gave 3.10, 2.98, 3.37, 3.47 in CI; the default teacher now (3 steps, one plausible answer per prompt)
    # gave 1.09-1.13 at step 1 and 0.54-0.81 as the mean of steps 3-4 in 4 of 4 runs
    assert sum(kl[2:]) / 2 < kl[0], kl
