"""The policy, critic and reward-model workers declare their dp x tp x sp meshes, and the trainer's calls go
through the N-D dispatch: rows split over dp groups, replicated to every tp / sp rank of a group, collected
from the group's first rank.

The workers here are the real role classes, in one process, with a recording engine in place of the model."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from hybridflow.controller.colocate import create_colocated_worker_cls
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.controller.worker_group import WorkerGroup
from hybridflow.engine.config import EngineConfig
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout.config import RolloutConfig, SamplingParams
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker
from hybridflow.workers.config import ActorConfig, CriticConfig, ModelConfig, RefConfig, RewardModelConfig
from hybridflow.workers.reward_model import RewardModelWorker

R = 3


class RecordingEngine:
    """Stands in for an engine: remembers the rows it was given, answers with the rank in every entry."""

    def __init__(self, rank: int) -> None:
        self.rank, self.seen, self.temperatures = rank, [], []

    def compute_log_probs(self, batch: Any, micro: Any, temperature: float = 1.0, calc_entropy: bool = False):
        self.seen.append(batch["row"].tolist())
        self.temperatures.append(temperature)
        out = torch.full((len(batch["row"]), R), float(self.rank))
        return out, out.clone() if calc_entropy else None

    def compute_values(self, batch: Any, micro: Any) -> torch.Tensor:
        return self.compute_log_probs(batch, micro)[0]


class ScoringEngine:
    """Stands in for a reward model's engine: counts the rows it scores, answers with the rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.rows = rank, []

    def compute_values(self, batch: Any, micro: Any) -> torch.Tensor:
        self.rows.append(len(batch[K.INPUT_IDS]))
        return torch.full(batch[K.RESPONSES].shape, float(self.rank))


class InProcessGroup(WorkerGroup):
    """`world` worker instances in this process (each built under its own RANK/WORLD_SIZE)."""

    def __init__(self, cls: ClassWithInitArgs, world: int) -> None:
        super().__init__("inproc", world)
        self.workers = []
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
        try:
            for rank in range(world):
                os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
                self.workers.append(cls())
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        self._bind_worker_methods(cls.cls)

    def _execute(self, method_name: str, ranks: list[int], per_rank: list) -> list:
        return [getattr(self.workers[r], method_name)(*a, **k) for r, (a, k) in zip(ranks, per_rank)]

    def _wait(self, method_name: str, ranks: list[int], outputs: list) -> list:
        return outputs

    def _make_future(self, method_name, ranks, outputs, collect, collects_proto):
        return collect(outputs)


def _rows(n: int) -> DataProto:
    ids = torch.zeros(n, 5, dtype=torch.long)
    mask = torch.ones(n, 5, dtype=torch.long)
    return DataProto.from_dict(
        {
            "row": torch.arange(n),
            K.INPUT_IDS: ids,
            K.ATTENTION_MASK: mask,
            K.RESPONSES: ids[:, -R:],
            K.RESPONSE_MASK: mask[:, -R:],
        }
    )


class RecordingRollout:
    """Stands in for a rollout: remembers the prompt rows, tags its outputs with the rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.seen, self.calls = rank, [], []

    def reseed(self, step: int) -> None:
        self.calls.append(("reseed", step))

    def generate_sequences(self, prompts: DataProto, sampling: SamplingParams | None = None) -> DataProto:
        self.seen.append(prompts.batch["row"].tolist())
        self.calls.append(("generate", sampling))
        return DataProto.from_dict({"row": prompts.batch["row"], "by": torch.full((len(prompts),), self.rank)})


def _policy(tp: int, rollout_tp: int = 1, sp: int = 1) -> ClassWithInitArgs:
    actor = ActorConfig(engine=EngineConfig(tensor_parallel_size=tp, ulysses_sequence_parallel_size=sp))
    rollout = RolloutConfig(tensor_model_parallel_size=rollout_tp)
    return ClassWithInitArgs(ActorRolloutRefWorker, ModelConfig(), actor, rollout, RefConfig(), "actor_rollout_ref")


@pytest.mark.parametrize("world,tp,sp", [(4, 2, 1), (2, 2, 1), (4, 1, 1), (4, 1, 2), (2, 1, 2)])
def test_policy_calls_split_over_dp_and_collect_one_rank_per_group(world, tp, sp):
    group = InProcessGroup(_policy(tp, sp=sp), world)
    for w in group.workers:
        w.actor = w.ref = RecordingEngine(w.rank)
    per = tp * sp  # ranks of one dp group
    dp = world // per
    out = group.compute_log_prob(_rows(8), temperature=0.7)
    assert [w.actor.temperatures for w in group.workers] == [[0.7]] * world  # keywords reach every rank
    # each tp / sp rank of dp group d got the d-th contiguous shard, the same rows as its peers
    for w in group.workers:
        d, rows = w.rank // per, 8 // dp
        assert w.actor.seen == [list(range(d * rows, (d + 1) * rows))]
    # one output per dp group (its first rank), in dp order
    assert out.batch[K.OLD_LOG_PROBS][:, 0].tolist() == [float(d * per) for d in range(dp) for _ in range(8 // dp)]
    ref = group.compute_ref_log_prob(_rows(6), temperature=0.7)  # 6 rows: padded to a multiple of dp, padding dropped
    assert len(ref) == 6
    assert [len(w.ref.seen[-1]) for w in group.workers] == [-(-6 // dp)] * world
    assert group.get_dispatch_info("rollout") == [(r, True) for r in range(world)]  # generation: plain dp


def test_colocated_critic_declares_its_own_mesh():
    """Actor tp 2 and critic tp 1 in the same four processes: each role's calls follow its own mesh."""
    critic = CriticConfig(engine=EngineConfig(tensor_parallel_size=1))
    fused = create_colocated_worker_cls(
        {"policy": _policy(2), "critic": ClassWithInitArgs(CriticWorker, ModelConfig(), critic, 1)}
    )
    groups = InProcessGroup(fused, 4).spawn(["policy", "critic"])
    workers = groups["policy"].workers
    for w in workers:
        w.workers["policy"].actor = RecordingEngine(w.rank)
        w.workers["critic"].engine = RecordingEngine(w.rank)
    groups["policy"].compute_log_prob(_rows(4), temperature=1.0)
    values = groups["critic"].compute_values(_rows(4))
    assert [w.workers["policy"].actor.seen for w in workers] == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]
    assert [w.workers["critic"].engine.seen for w in workers] == [[[0]], [[1]], [[2]], [[3]]]
    assert values.batch[K.VALUES][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_worker_refuses_tp_or_sp_that_does_not_divide_its_world():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the number of ranks \(4\)"):
        InProcessGroup(_policy(3), 4)
    with pytest.raises(
        ValueError,
        match=r"actor.engine.ulysses_sequence_parallel_size=2 must divide the number of "
        r"ranks \(3\)",
    ):
        InProcessGroup(_policy(1, sp=2), 3)


def test_critic_and_reward_model_replicate_over_their_sp_ranks():
    """Critic sp 2 and reward model sp 4 on four processes: rows counted per rank, one output per dp group."""
    critic = InProcessGroup(
        ClassWithInitArgs(
            CriticWorker, ModelConfig(), CriticConfig(engine=EngineConfig(ulysses_sequence_parallel_size=2)), 1
        ),
        4,
    )
    for w in critic.workers:
        w.engine = RecordingEngine(w.rank)
    values = critic.compute_values(_rows(6))
    assert [w.engine.seen for w in critic.workers] == [[[0, 1, 2]], [[0, 1, 2]], [[3, 4, 5]], [[3, 4, 5]]]
    assert values.batch[K.VALUES][:, 0].tolist() == [0.0] * 3 + [2.0] * 3
    rm = InProcessGroup(ClassWithInitArgs(RewardModelWorker, RewardModelConfig(ulysses_sequence_parallel_size=4)), 4)
    for w in rm.workers:
        w.engine = ScoringEngine(w.rank)
    scores = rm.compute_rm_score(_rows(3))
    assert [w.engine.rows for w in rm.workers] == [[3]] * 4  # one dp group: every sp rank gets all rows
    assert scores.batch[K.RM_SCORES][:, -1].tolist() == [0.0] * 3  # collected from sp rank 0


def test_generation_follows_the_rollout_mesh_not_the_actor_mesh():
    """Actor tp 1, rollout tp 2 on four processes: prompts split over two rollout groups."""
    group = InProcessGroup(_policy(1, rollout_tp=2), 4)
    for w in group.workers:
        w.rollout = RecordingRollout(w.rank)
    sampling = SamplingParams(temperature=0.5)
    out = group.generate_sequences(_rows(4), step=5, sampling=sampling)
    assert [w.rollout.seen for w in group.workers] == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]
    assert all(w.rollout.calls == [("reseed", 5), ("generate", sampling)] for w in group.workers)
    assert out.batch["row"].tolist() == [0, 1, 2, 3] and out.batch["by"].tolist() == [0, 0, 2, 2]
    assert group.get_dispatch_info("policy") == [(r, True) for r in range(4)]


def test_rollout_groups_are_spaced_beside_a_sharded_fsdp_actor():
    """Actor FSDP over all 4 ranks, rollout tp 2: tp groups {0,2} and {1,3}, so that each rank's FSDP rows lie in
    its generation shard (engine/reshard.py aligned_stride); prompts split over dp ranks 0 (ranks 0, 2) and 1."""
    actor = ActorConfig(engine=EngineConfig(fsdp_size=-1))
    policy = ClassWithInitArgs(
        ActorRolloutRefWorker,
        ModelConfig(),
        actor,
        RolloutConfig(tensor_model_parallel_size=2),
        RefConfig(),
        "actor_rollout_ref",
    )
    group = InProcessGroup(policy, 4)
    assert [w.rollout_stride for w in group.workers] == [2] * 4
    for w in group.workers:
        w.rollout = RecordingRollout(w.rank)
    out = group.generate_sequences(_rows(4), validate=True)
    assert [w.rollout.seen for w in group.workers] == [[[0, 1]], [[2, 3]], [[0, 1]], [[2, 3]]]
    val = group.workers[0].rollout_cfg.sampling_params(validate=True)
    assert all(w.rollout.calls == [("generate", val)] for w in group.workers)  # validation: no reseed
    assert out.batch["row"].tolist() == [0, 1, 2, 3] and out.batch["by"].tolist() == [0, 0, 1, 1]
