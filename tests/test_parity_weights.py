"""Weight-sync parity (hybridflow/parity/weights.py): a healthy sync gives no finding; each injected fault
(tests/faults/parity.py) gives one at its step naming the backend, the path, the step and the tensors. The
colocated and LoRA syncs run through `ActorRolloutRefWorker.generate_sequences` (in-process backend), the bridge
through two workers' `transfer_weights` (two threads, real gloo); the reshard is in test_parity_reshard.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import pytest
import torch
from faults import arm, disarm

from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.engine import EngineConfig, LoraConfig, OptimConfig
from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.parity.fingerprint import tensor_fingerprint
from hybridflow.parity.weights import bridge_expected, prints_once
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout import RolloutConfig
from hybridflow.workers import ActorConfig, ActorRolloutRefWorker, ModelConfig, RefConfig
from tests.engine_helpers import make_batch
from tests.rollout_helpers import prompt_batch

Q0 = "model.layers.0.self_attn.q_proj.weight"  # the tensor corrupt_tensor alters (the first decoder weight)
ADAPTED = [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv"]


@pytest.fixture(autouse=True)
def _disarmed():
    """Every test here arms its faults in this process (`arm`); none outlives it."""
    yield
    disarm()


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


def _faults(spec: str) -> dict[int, str]:
    """step -> fault kind of a parity fault spec (one kind per step here)."""
    return {int(step): kind for kind, step in (point.split("@") for point in spec.split(","))}


def _generate_after_updates(group: LocalWorkerGroup, steps: int) -> dict[int, tuple[list[str], dict]]:
    """Steps 1..`steps`: update, then generate (the rollout syncs first); step -> (findings, metrics)."""
    prompts = prompt_batch(load_tokenizer(tiny_model_dir("llama")))
    out = {}
    for step in range(1, steps + 1):
        _update(group)
        meta = group.generate_sequences(prompts, step=step).meta_info
        out[step] = (meta.get(K.META_PARITY, []), meta[K.META_METRICS])
    return out


def _check_findings(got: dict[int, list[str]], spec: str, where: str, names: list[str]) -> None:
    """No finding at a healthy step; at a faulty one exactly one line, `where` and the step, naming the right
    tensors among `names` (what each sync sends, in order)."""
    faults = _faults(spec)
    for step, findings in got.items():
        if step not in faults:
            assert findings == [], (step, findings)
            continue
        line = _one(findings, f"{where}, step={step}")
        if faults[step] == "corrupt_tensor":
            assert f"1 of {len(names)} tensors differ, first: {Q0};" in line
        else:  # every trained weight differs; in bf16 a norm weight's update may round away
            assert f"tensors differ, first: {names[0]}, {names[1]}, " in line, line


def _one(findings: list[str], where: str) -> str:
    assert len(findings) == 1 and f"weight sync mismatch ({where})" in findings[0], findings
    return findings[0]


GENERIC = "skip_sync@2,corrupt_tensor@3,wrong_dtype@4"
"""The faults every sync path can suffer, after a healthy first step."""


@pytest.mark.parametrize("backend, dtype", [("native", "fp32"), pytest.param("hf", "bf16", marks=pytest.mark.slow)])
def test_colocated_sync_faults_are_found_at_their_step(backend: str, dtype: str) -> None:
    arm(parity=GENERIC)
    group = _group("actor_rollout", _rollout_cfg(backend, dtype))
    got = _generate_after_updates(group, 4)
    names = list(group.worker.rollout.held_weights())  # what a full sync sends (the tied head under its name too)
    _check_findings({k: v[0] for k, v in got.items()}, GENERIC, f"rollout={backend}, path=colocated", names)
    assert "usual cause: the rollout kept stale weights" in got[2][0][0]
    if dtype == "fp32":  # a skipped sync: every weight trained
        assert f"{len(names)} of {len(names)} tensors differ" in got[2][0][0]
    assert all(metrics["timing_s/parity_weights"] > 0.0 for _, metrics in got.values())


def test_fingerprints_off_means_no_check() -> None:
    arm(parity="corrupt_tensor@1")
    got = _generate_after_updates(_group("actor_rollout", _rollout_cfg(weight_fingerprints=False)), 1)
    assert got[1][0] == [] and "timing_s/parity_weights" not in got[1][1]


@pytest.mark.parametrize(
    "spec", ["lora_unmerged@2", pytest.param("lora_unmerged@2,skip_sync@4,corrupt_tensor@5", marks=pytest.mark.slow)]
)
def test_lora_merged_sync_faults_are_found(spec: str) -> None:
    """Step 1 syncs every weight; later steps only the adapted layers' merged weights."""
    arm(parity=spec)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    got = {
        k: v[0]
        for k, v in _generate_after_updates(
            _group("actor_rollout", _rollout_cfg(), lora), max(_faults(spec)) + 1
        ).items()
    }
    _check_findings(got, spec, "rollout=native, path=lora", ADAPTED)
    line = got[2][0]
    assert f"4 of 4 tensors differ, first: {', '.join(ADAPTED[:3])}, ...;" in line  # only the adapted ones are sent
    assert "usual cause: the adapters not merged" in line


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


@pytest.mark.parametrize(
    "spec",
    [
        "bridge_drop@2,corrupt_tensor@3",
        pytest.param("bridge_drop@2,corrupt_tensor@3,wrong_dtype@4,skip_sync@5", marks=pytest.mark.slow),
    ],
)
def test_bridge_faults_are_found_at_the_push(spec: str) -> None:
    arm(parity=spec)
    actor, rollout = _group("actor", _rollout_cfg()), _group("rollout", _rollout_cfg())
    host, port, manifest = actor.open_weight_bridge("127.0.0.1", 2)[0]
    _both(lambda: actor.join_weight_bridge(host, port, 2), lambda: rollout.join_weight_bridge(host, port, 2, manifest))
    got = {}
    for step in range(1, max(_faults(spec)) + 1):
        _update(actor)
        results = _both(partial(actor.transfer_weights, step=step), partial(rollout.transfer_weights, step=step))
        got[step] = results[0].get()
    names = [name for name, _, _ in manifest]
    _check_findings({k: r[K.META_PARITY] for k, r in got.items()}, spec, "rollout=native, path=bridge", names)
    assert f"{len(names)} of {len(names)} tensors differ" in got[2][K.META_PARITY][0]  # the dropped update
    assert "usual cause: an update dropped" in got[2][K.META_PARITY][0]
    assert all(r["timing_s/parity_weights"] > 0.0 for r in got.values())


class _ChunkRollout:
    """A rollout that keeps rows 2:4 of "w" (as a tp rank does) and "b" whole."""

    def as_held(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t[2:4] if name == "w" else t


def test_a_split_rollout_on_the_bridge_expects_its_chunk_of_what_was_sent() -> None:
    sent_state = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    sent = prints_once(sent_state)
    expected = bridge_expected(_ChunkRollout(), sent_state, sent)
    assert expected == {"w": tensor_fingerprint(sent_state["w"][2:4]), "b": sent["b"]}
    altered = {"w": sent_state["w"].clone(), "b": sent_state["b"]}
    altered["w"][0, 0] += 1.0  # a row this rank does not keep: still a transport error, reported
    assert bridge_expected(_ChunkRollout(), altered, sent)["w"] == -1


def test_a_validation_calls_findings_reach_the_next_training_batch(monkeypatch):
    from hybridflow.rollout.sync import SyncReport
    from hybridflow.workers import actor_rollout_ref

    group = _group("actor_rollout", _rollout_cfg())
    prompts = prompt_batch(load_tokenizer(tiny_model_dir("llama")))
    report = SyncReport(findings=["weight sync mismatch (rollout=native, path=colocated, step=None): test"])
    monkeypatch.setattr(actor_rollout_ref, "sync_weights", lambda *args: report)
    _update(group)
    assert K.META_PARITY not in group.generate_sequences(prompts, validate=True).meta_info  # the sync ran here
    assert group.generate_sequences(prompts, step=2).meta_info[K.META_PARITY] == report.findings
    assert K.META_PARITY not in group.generate_sequences(prompts, step=3).meta_info  # reported once
