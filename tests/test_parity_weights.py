"""Weight-sync parity (hybridflow/parity/weights.py): a healthy sync gives no finding; each injected fault
(HYBRIDFLOW_PARITY_FAULT) gives one at its step naming the backend, the path, the step and the tensors. The
colocated and LoRA syncs run through `ActorRolloutRefWorker.generate_sequences` (in-process backend), the bridge
through two workers' `transfer_weights` (two threads, real gloo); the reshard is in test_parity_reshard.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import pytest
import torch

from hybridflow import keys as K
from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.engine import EngineConfig, LoraConfig, OptimConfig
from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.parity.faults import PARITY_FAULT_ENV
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutConfig
from hybridflow.workers import ActorConfig, ActorRolloutRefWorker, ModelConfig, RefConfig
from tests.engine_helpers import make_batch
from tests.rollout_helpers import prompt_batch

Q0 = "model.layers.0.self_attn.q_proj.weight"  # the tensor corrupt_tensor alters (the first decoder weight)
ADAPTED = [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv"]


def _group(role: str, rollout: RolloutConfig, lora: LoraConfig | None = None) -> LocalWorkerGroup:
    actor = ActorConfig(
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_device=4,
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(param_dtype="fp32"),
        lora=lora or LoraConfig(),
    )
    model = ModelConfig(path=str(tiny_model_dir("llama")))
    group = LocalWorkerGroup(None, ClassWithInitArgs(ActorRolloutRefWorker, model, actor, rollout, RefConfig(), role))
    group.init_model()
    return group


def _rollout_cfg(name: str = "native", dtype: str = "fp32", **kw) -> RolloutConfig:
    return RolloutConfig(name=name, dtype=dtype, n=1, response_length=2, prompt_length=64, do_sample=False, **kw)


def _update(group: LocalWorkerGroup) -> None:
    """One optimizer step on fixed rows: every trained weight changes."""
    data = make_batch(4, 6, 5, seed=11)
    data[K.RESPONSE_MASK] = data[K.ATTENTION_MASK][:, -5:]
    data[K.ADVANTAGES] = torch.tensor([1.0, -0.5, 0.25, -1.0])[:, None] * data[K.RESPONSE_MASK]
    group.update_actor(DataProto.from_dict(data), temperature=1.0, own_old_log_prob=True)


def _findings_by_step(group: LocalWorkerGroup, steps: range) -> dict[int, tuple[list[str], dict]]:
    """Generate at step 1 (no sync: the rollout starts from the actor's weights), then update and generate
    (synced) at each later step; step -> (findings, metrics) of its generation."""
    prompts = prompt_batch(load_tokenizer(tiny_model_dir("llama")))
    group.generate_sequences(prompts, step=steps[0])
    out = {}
    for step in steps[1:]:
        _update(group)
        meta = group.generate_sequences(prompts, step=step).meta_info
        out[step] = (meta.get(K.META_PARITY, []), meta[K.META_METRICS])
    return out


def _one(findings: list[str], where: str) -> str:
    assert len(findings) == 1 and f"weight sync mismatch ({where})" in findings[0], findings
    return findings[0]


@pytest.mark.parametrize("backend, dtype", [("native", "fp32"), ("hf", "bf16")])
def test_colocated_sync_faults_are_found_at_their_step(monkeypatch, backend: str, dtype: str) -> None:
    monkeypatch.setenv(PARITY_FAULT_ENV, "skip_sync@3,corrupt_tensor@4,wrong_dtype@5")
    group = _group("actor_rollout", _rollout_cfg(backend, dtype))
    total = len(group.worker.rollout.held_weights())  # the tied head is sent under its own name too
    got = _findings_by_step(group, range(1, 7))
    assert got[2][0] == [] and got[6][0] == []  # healthy syncs, also right after a faulty one
    where = f"rollout={backend}, path=colocated, step="
    stale = _one(got[3][0], where + "3")
    assert f"tensors differ, first: model.embed_tokens.weight, {Q0}, " in stale
    if dtype == "fp32":  # in bf16 a norm weight's update rounds away
        assert f"{total} of {total} tensors differ" in stale
    assert f"1 of {total} tensors differ, first: {Q0};" in _one(got[4][0], where + "4")
    assert "tensors differ" in _one(got[5][0], where + "5") and "usual cause: the rollout kept stale" in got[5][0][0]
    assert all(metrics["timing_s/parity_weights"] > 0.0 for _, metrics in got.values())


def test_fingerprints_off_means_no_check(monkeypatch) -> None:
    monkeypatch.setenv(PARITY_FAULT_ENV, "corrupt_tensor@2")
    got = _findings_by_step(_group("actor_rollout", _rollout_cfg(weight_fingerprints=False)), range(1, 3))
    assert got[2][0] == [] and "timing_s/parity_weights" not in got[2][1]


def test_lora_merged_sync_faults_are_found(monkeypatch) -> None:
    monkeypatch.setenv(PARITY_FAULT_ENV, "lora_unmerged@3,skip_sync@5")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    got = _findings_by_step(_group("actor_rollout", _rollout_cfg(), lora), range(1, 6))
    assert got[2][0] == [] and got[4][0] == []  # the first (full) sync and a changed-only one
    line = _one(got[3][0], "rollout=native, path=lora, step=3")
    assert f"4 of 4 tensors differ, first: {', '.join(ADAPTED[:3])}, ...;" in line  # only the adapted ones are sent
    assert "usual cause: the adapters not merged" in line
    assert "4 of 4 tensors differ" in _one(got[5][0], "rollout=native, path=lora, step=5")


# --- the bridge (trainer.mode one_step_off / async) ----------------------------------------------------------------


def _both(actor_call: Callable[[], object], rollout_call: Callable[[], object]) -> object:
    """Run the actor's side in a thread and the rollout's here (a bridge collective needs both); the rollout's result."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            actor_call()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    result = rollout_call()
    thread.join(timeout=60)
    assert not errors, errors
    return result


def test_bridge_faults_are_found_at_the_push(monkeypatch) -> None:
    monkeypatch.setenv(PARITY_FAULT_ENV, "bridge_drop@2,corrupt_tensor@3,wrong_dtype@4,skip_sync@5")
    actor, rollout = _group("actor", _rollout_cfg()), _group("rollout", _rollout_cfg())
    host, port, manifest = actor.open_weight_bridge("127.0.0.1", 2)[0]
    _both(lambda: actor.join_weight_bridge(host, port, 2), lambda: rollout.join_weight_bridge(host, port, 2, manifest))
    got = {}
    for step in range(1, 7):
        _update(actor)
        results = _both(partial(actor.transfer_weights, step=step), partial(rollout.transfer_weights, step=step))
        got[step] = results[0].get()
    assert got[1][K.META_PARITY] == [] and got[6][K.META_PARITY] == []
    total = len(manifest)
    where = "rollout=native, path=bridge, step="
    assert f"{total} of {total} tensors differ" in _one(got[2][K.META_PARITY], where + "2")
    assert f"1 of {total} tensors differ, first: {Q0};" in _one(got[3][K.META_PARITY], where + "3")
    assert "usual cause: an update dropped" in _one(got[4][K.META_PARITY], where + "4")
    assert f"{total} of {total} tensors differ" in _one(got[5][K.META_PARITY], where + "5")
    assert all(r["timing_s/parity_weights"] > 0.0 for r in got.values())
