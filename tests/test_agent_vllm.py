"""Multi-turn rollouts over the vllm rollout (rollout.name=vllm, rollout.multi_turn): the loop drives vllm
with ids in and ids out, the trained ids are the sampled ones over several turns, observations are masked and
the rollout log-probs are the model's.

Marked `vllm`: run inside .venv-vllm with `.venv-vllm/bin/python -m pytest -m vllm`; skipped without vllm.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm_required import require_vllm

from hybridflow.agent.config import MultiTurnConfig
from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir
from hybridflow.protocol import keys as K
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.multi_turn import generate_multi_turn
from tests.rollout_helpers import recomputed_log_probs
from tests.test_agent_cli import multi_turn_args
from tests.test_agent_rollout import ENV, assert_the_sampled_turns_are_trained, prompts, stopping_model
from tests.test_trainer_cli import read_metrics, run_cli

require_vllm()
pytestmark = pytest.mark.vllm


def test_vllm_multi_turn_trains_the_sampled_ids_and_masks_the_observations(tmp_path):
    # a head size vllm's CPU attention supports (32), as in tests/test_rollout_vllm.py
    model, stops = stopping_model(tmp_path, tiny_model_dir("llama", hidden_size=128))
    tok = load_tokenizer(model)
    config = RolloutConfig(
        name="vllm",
        n=2,
        prompt_length=64,
        response_length=48,
        dtype="fp32",
        max_batch_size=8,
        calculate_log_probs=True,
        multi_turn=MultiTurnConfig(enable=True, env=ENV, max_turn_tokens=10),
    )
    rollout = build_rollout(config, model, tok)
    assert rollout.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # later turns reuse the KV blocks
    assert set(stops) <= set(rollout.eos_ids)  # the generation config's EOS ids end a turn, as for native / hf
    sampled, budgets, plain = [], [], rollout.generate_ids

    def recording(batch, max_tokens, sampling):
        turns = plain(batch, max_tokens, sampling)
        sampled.append([ids for ids, _ in turns])
        budgets.append(max_tokens)
        return turns

    rollout.generate_ids = recording
    rollout.reseed(1)
    out = generate_multi_turn(rollout, prompts(tok), config.sampling_params(), config)
    assert len(sampled) >= 2
    for call, limits in zip(sampled, budgets):
        assert all(len(ids) == limit or ids[-1] in stops for ids, limit in zip(call, limits))
    assert_the_sampled_turns_are_trained(out, tok, stops, sampled)
    expect = recomputed_log_probs(load_causal_lm(model, dtype=torch.float32).eval(), out)
    mask = out.batch[K.RESPONSE_MASK].bool()
    torch.testing.assert_close(out.batch[K.ROLLOUT_LOG_PROBS][mask], expect[mask], atol=1e-4, rtol=0)
    assert (out.batch[K.ROLLOUT_LOG_PROBS][~mask] == 0).all()


def test_vllm_multi_turn_trains_through_the_cli(tmp_path: Path):
    """The worker's generate_sequences runs the loop over its vllm engine, in training and in validation."""
    args = [
        *multi_turn_args(tmp_path, "Echo", source=tiny_model_dir("llama", hidden_size=128)),
        "rollout.name=vllm",
        "rollout.calculate_log_probs=true",
        "trainer.backend=local",
    ]
    proc = run_cli(["train", *args], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = read_metrics(tmp_path)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(1 <= r["agent/turns/mean"] <= 3 and r["actor/rollout_probs_diff_mean"] < 0.02 for r in steps), steps
    assert any(r["agent/turns/mean"] > 1 for r in steps)
    assert "val-aux/agent/turns/mean" in records[-1]


def test_vllm_multi_turn_trains_one_step_off_on_its_own_rollout_workers(tmp_path: Path):
    """The loop over a vllm engine on the rollout's own Ray workers, step 2's batch generated while step 1 trains,
    every token stamped with the version of the weights that sampled it."""
    args = [
        *multi_turn_args(tmp_path, "Echo", workers=2, source=tiny_model_dir("llama", hidden_size=128)),
        "rollout.name=vllm",
        "rollout.calculate_log_probs=true",
        "trainer.mode=one_step_off",
        "trainer.placement=split",
    ]
    proc = run_cli(["train", *args], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["async/staleness/max"] for r in steps] == [0.0, 1.0]
    assert all(r["parity/token_mismatch_rows"] == 0 and r["async/partial_rows"] == 0 for r in steps)
