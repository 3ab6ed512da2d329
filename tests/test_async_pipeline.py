"""trainer.mode one_step_off / async without workers: config, worker sets, the weight bridge between two
ranks, and the pipeline's schedule against fake worker groups that model Ray's in-order execution."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridflow.config.resolve import resolve_trainer, worker_sets
from hybridflow.config.run import RunConfig
from hybridflow.config.trainer import TrainerConfig
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout.bridge import WeightBridge, manifest_of, open_store
from hybridflow.train import async_pipeline
from hybridflow.train.async_pipeline import AsyncRollout, RolloutSource, SyncRollout, staleness_metrics
from hybridflow.utils.config_loader import load_config

SPLIT = ["trainer.placement=split"]


def test_off_policy_worker_sets() -> None:
    sets = worker_sets(load_config(RunConfig, None, SPLIT + ["trainer.mode=one_step_off"]))
    assert [(s.pool, s.world_size, s.roles) for s in sets] == [(0, 1, ("actor",)), (1, 1, ("rollout",))]
    cfg = load_config(
        RunConfig, None, SPLIT + ["trainer.mode=async", "actor.use_kl_loss=true", "trainer.n_workers_per_node=4"]
    )
    assert [(s.world_size, s.roles) for s in worker_sets(cfg)] == [(2, ("actor", "ref")), (2, ("rollout",))]


def test_max_staleness_derived_from_mode() -> None:
    def staleness(**kw) -> int:
        return resolve_trainer(TrainerConfig(**kw), steps_per_epoch=4, cpu_count=2).max_staleness

    assert staleness() == 0
    assert staleness(mode="one_step_off", placement="split") == 1
    assert staleness(mode="async", placement="split") == 1
    assert staleness(mode="async", placement="split", max_staleness=3) == 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.mode=async"], "set trainer.placement=split"),
        (["trainer.mode=eager"], "trainer.mode must be one of"),
        (SPLIT + ["trainer.mode=one_step_off", "trainer.max_staleness=2"], "use trainer.mode=async"),
        (["trainer.max_staleness=1"], "trainer.mode=sync means trainer.max_staleness=0"),
        (SPLIT + ["trainer.mode=async", "trainer.max_staleness=-1"], "must be >= 0"),
        (SPLIT + ["trainer.mode=async", "algorithm.adv_estimator=remax"], "remax"),
        (SPLIT + ["trainer.mode=async", "trainer.backend=local", "trainer.n_workers_per_node=1"], "at least 2 workers"),
    ],
)
def test_bad_combinations_refused_at_load(overrides: list[str], message: str) -> None:
    with pytest.raises(Exception, match=message):
        load_config(RunConfig, None, overrides)


def test_staleness_metrics_and_cap() -> None:
    m = staleness_metrics(torch.tensor([0, 0, 1, 1]), step=3, cap=2)  # trained by version 2
    assert m == {
        "async/staleness/mean": 1.5,
        "async/staleness/max": 2.0,
        "async/staleness_hist/0": 0.0,
        "async/staleness_hist/1": 0.5,
        "async/staleness_hist/2": 0.5,
    }
    with pytest.raises(RuntimeError, match="above trainer.max_staleness=1"):
        staleness_metrics(torch.tensor([0, 1]), step=3, cap=1)
    with pytest.raises(RuntimeError, match="from the future"):
        staleness_metrics(torch.tensor([3]), step=3, cap=1)


def test_weight_bridge_broadcasts_between_two_ranks() -> None:
    """Rank 0 sends a mixed-dtype state dict; rank 1 receives it by manifest (two threads, real gloo)."""
    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.bfloat16), "c": torch.randn(2)}
    store, port = open_store("127.0.0.1", 2, 30.0)
    received: dict = {}

    def receiver() -> None:
        received.update(WeightBridge("127.0.0.1", port, 1, 2, 30.0).receive(manifest_of(state)))

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = WeightBridge("127.0.0.1", port, 0, 2, 30.0, store=store)
    sent = sender.send(state)
    thread.join(timeout=30)
    assert list(received) == list(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    assert sent == 3 * 4 * 4 + 5 * 2 + 2 * 4


# --- the schedule, with fake groups ---------------------------------------------------------------


class FakeRollout:
    """Generates rows stamped with the weights it holds when the call is issued (= when it runs, since a
    Ray actor runs calls in issue order and the pipeline waits for every push)."""

    world_size = 1

    def __init__(self, log: list) -> None:
        self.weights, self.log = 0, log

    def call_nonblocking(self, method: str, prompts: DataProto, *, step: int) -> DataProto:
        assert method == "generate_sequences" and prompts.meta_info[K.META_GLOBAL_STEP] == step
        self.log.append(("gen", step))
        rows = prompts.batch["prompt_id"].repeat_interleave(2)
        return DataProto.from_dict(
            {"prompt_id": rows, "made_by": torch.full_like(rows, self.weights)}, meta_info={K.META_METRICS: {}}
        )

    def join_weight_bridge(self, *args) -> list:
        return []

    def transfer_weights(self, step: int) -> list:
        return [{"timing_s/weight_transfer": 0.0}]


class FakeActor:
    world_size = 1

    def __init__(self, rollout: FakeRollout, weights: int = 0) -> None:
        self.rollout, self.weights = rollout, weights

    def open_weight_bridge(self, host: str, world: int) -> list:
        return [(host, 1, [])]

    def join_weight_bridge(self, *args) -> list:
        return []

    def transfer_weights(self, step: int) -> list:
        self.rollout.weights = self.weights
        self.rollout.log.append(("push", self.weights))
        return [{"timing_s/weight_transfer": 0.0, "weight_transfer/bytes": 0.0}]


class FakeRoles:
    def __init__(self, weights: int = 0) -> None:
        self.log: list = []
        self.rollout = FakeRollout(self.log)
        self.actor_rollout = FakeActor(self.rollout, weights)


def _prompts(start: int = 0) -> Iterator[DataProto]:
    i = start
    while True:
        yield DataProto.from_dict({"prompt_id": torch.tensor([2 * i, 2 * i + 1])})
        i += 1


def _pipeline(roles: FakeRoles, s: int, total: int, prompts: Iterator[DataProto]) -> AsyncRollout:
    return AsyncRollout(roles, prompts, total, s, wait=lambda refs: refs)


def _train(pipe: AsyncRollout, roles: FakeRoles, first: int, last: int) -> dict[int, tuple[DataProto, dict]]:
    out = {}
    for k in range(first, last + 1):
        batch = pipe.batch(k)
        roles.actor_rollout.weights = k  # the update of step k
        out[k] = (batch, pipe.after_update(k, batch))
    return out


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch) -> None:
    monkeypatch.setattr(async_pipeline, "bridge_host", lambda: "127.0.0.1")


@pytest.mark.parametrize("s", [0, 1, 2])
def test_schedule_versions_and_staleness(s: int) -> None:
    roles, total = FakeRoles(), 6
    pipe = _pipeline(roles, s, total, _prompts())
    pipe.start(0, None, {})
    for k, (batch, metrics) in _train(pipe, roles, 1, total).items():
        # the recorded version is the one that really generated the rows, and it is the schedule's
        assert torch.equal(batch.batch[K.POLICY_VERSION], batch.batch["made_by"]), k
        assert set(batch.batch[K.POLICY_VERSION].tolist()) == {max(0, k - s - 1)}, k
        assert metrics["async/staleness/max"] == min(k - 1, s) <= s
        assert torch.equal(batch.batch["prompt_id"], torch.tensor([2 * k - 2] * 2 + [2 * k - 1] * 2))
    assert [e for e in roles.log if e[0] == "gen"] == [("gen", k) for k in range(1, total + 1)]


def test_a_push_finding_reaches_the_next_batch_the_controller_sees() -> None:
    roles = FakeRoles()
    line = "weight sync mismatch (rollout=native, path=bridge, step=2): ..."
    roles.rollout.transfer_weights = lambda step: [
        {"timing_s/weight_transfer": 0.0, "timing_s/parity_weights": 0.5, K.META_PARITY: [line] if step == 2 else []}
    ]
    pipe = _pipeline(roles, 1, 5, _prompts())
    pipe.start(0, None, {})
    out = _train(pipe, roles, 1, 5)
    assert [out[k][0].meta_info.get(K.META_PARITY) for k in range(1, 6)] == [None, None, [line], None, None]
    assert out[2][1]["timing_s/parity_weights"] == 0.5


def test_both_sources_implement_the_protocol_the_trainer_types() -> None:
    roles = FakeRoles()
    assert isinstance(SyncRollout(roles, _prompts()), RolloutSource)
    assert isinstance(_pipeline(roles, 1, 3, _prompts()), RolloutSource)


def test_sync_source_generates_with_the_step_and_stamps_it() -> None:
    calls = []

    class Policy:
        def generate_sequences(self, prompts: DataProto, **kwargs) -> DataProto:
            calls.append(kwargs)
            return DataProto.from_dict({"prompt_id": prompts.batch["prompt_id"]}, meta_info={K.META_METRICS: {}})

    source = SyncRollout(type("Roles", (), {"actor_rollout": Policy()})(), _prompts())
    batch = source.batch(3)
    assert calls == [{"step": 3}] and batch.meta_info[K.META_GLOBAL_STEP] == 3
    assert source.prompts_of(batch).meta_info == {K.META_GLOBAL_STEP: 3}  # ReMax regenerates them at step 3


def test_staleness_zero_issues_the_calls_of_sync() -> None:
    """sync: generate k (on the weights of update k - 1), update k; s=0 does exactly that, in that order."""
    roles = FakeRoles()
    pipe = _pipeline(roles, 0, 3, _prompts())
    pipe.start(0, None, {})
    _train(pipe, roles, 1, 3)
    assert roles.log == [("gen", 1), ("push", 1), ("gen", 2), ("push", 2), ("gen", 3), ("push", 3)]


def test_checkpoint_carries_the_queue(tmp_path: Path) -> None:
    """Stopped after step 2 and resumed (fresh rollout weights, loader after the prompts already pulled)
    gives the batches of an uninterrupted run."""
    s, total = 2, 6
    full_roles = FakeRoles()
    full = _pipeline(full_roles, s, total, _prompts())
    full.start(0, None, {})
    expected = _train(full, full_roles, 1, total)

    first_roles = FakeRoles()
    first = _pipeline(first_roles, s, total, _prompts())
    first.start(0, None, {})
    _train(first, first_roles, 1, 2)
    state = first.save(tmp_path)
    assert [k for k, _ in state["rollout_queue"]] == [3, 4]

    roles = FakeRoles(weights=2)  # the actor restored from the checkpoint; the rollout holds the initial weights
    resumed = _pipeline(roles, s, total, _prompts(start=first.issued))
    resumed.start(2, tmp_path, state)
    for k, (batch, metrics) in _train(resumed, roles, 3, total).items():
        want, want_metrics = expected[k]
        for key in ("prompt_id", "made_by", K.POLICY_VERSION):
            assert torch.equal(batch.batch[key], want.batch[key]), (k, key)
        untimed = {key: v for key, v in metrics.items() if not key.startswith("timing_s/")}
        assert untimed == {key: v for key, v in want_metrics.items() if not key.startswith("timing_s/")}
