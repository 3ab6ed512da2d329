"""Worker sets of a resolved run -> resource pools -> worker groups.

The resolved run says which roles live together (`ResolvedRun.worker_sets`):
- colocate (default): every role lives in every worker process (one process per
  device); the actor/rollout/ref, critic and reward model share memory and the
  process group, and run one after another.
- split: the policy (actor + rollout) gets the first half of the workers, the
  critic, reference and reward model the second half, so their calls overlap
  (the trainer issues them non-blocking). With trainer.mode one_step_off/async
  the rollout alone gets the second half, so generation overlaps training
  (hybridflow/train/async_pipeline.py).
Each set gets its own pool; the roles of a set are fused into one worker process.

The same code builds Ray worker groups or, with trainer.backend=local, one
in-process worker for debugging.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from hybridflow.config.resolve import POLICY_ROLES, ResolvedRun, WorkerSet
from hybridflow.config.run import RunConfig
from hybridflow.config.trainer import JobConfig
from hybridflow.controller.colocate import create_colocated_worker_cls
from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.controller.worker_group import Timeouts, WorkerGroup
from hybridflow.utils.quiet import worker_env
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker, TeacherWorker
from hybridflow.workers.judge import JudgeWorker


class Role(Enum):
    """The roles of a PPO program, verl's names and values (verl: `verl.trainer.ppo.ray_trainer.Role`), for keying
    a `ResourcePoolManager` mapping as a verl program does."""

    Actor = 0
    Rollout = 1
    ActorRollout = 2
    Critic = 3
    RefPolicy = 4
    RewardModel = 5
    ActorRolloutRef = 6


@dataclass
class Roles:
    """The worker groups the trainer calls; ref/critic/reward_model are None when unused."""

    actor_rollout: WorkerGroup
    """Computes old log-probs, updates the policy and (trainer.mode=sync) generates."""
    ref: WorkerGroup | None = None
    """Reference log-probs (may drive the same processes as actor_rollout)."""
    critic: WorkerGroup | None = None
    """Values and critic updates."""
    reward_model: WorkerGroup | None = None
    """Model-based reward scores."""
    rollout: WorkerGroup | None = None
    """Generates; the actor_rollout group itself unless trainer.mode puts the rollout on its own workers."""
    release: Callable[[], None] = lambda: None
    """Frees the placement the groups ran on (Ray placement groups); call after shutting them down."""
    teacher: WorkerGroup | None = None
    """The distillation teacher's log-probs (distillation.enabled)."""
    judge: WorkerGroup | None = None
    """The judge model's verdicts (judge.enable)."""

    def all(self) -> list[WorkerGroup]:
        """Distinct groups, for init/shutdown."""
        groups = [
            self.actor_rollout,
            self.rollout,
            self.ref,
            self.critic,
            self.reward_model,
            self.teacher,
            self.judge,
        ]
        return list({id(g): g for g in groups if g is not None}.values())


_CLASS_OF_ROLE = {
    "actor": "policy",
    "rollout": "policy",
    "ref": "policy",
    "critic": "critic",
    "reward_model": "reward_model",
    "teacher": "teacher",
    "judge": "judge",
}
"""Which worker class of a set hosts each role."""


def _set_classes(cfg: RunConfig, worker_set: WorkerSet) -> dict[str, ClassWithInitArgs]:
    """The worker classes of one set: the policy worker (with its roles joined), critic, reward model, teacher."""
    classes = {}
    policy_roles = [r for r in POLICY_ROLES if r in worker_set.roles]
    if policy_roles:
        classes["policy"] = ClassWithInitArgs(
            ActorRolloutRefWorker,
            cfg.model,
            cfg.actor,
            cfg.rollout,
            cfg.ref,
            "_".join(policy_roles),
            plugins=cfg.trainer.plugins,
        )
    if "critic" in worker_set.roles:
        classes["critic"] = ClassWithInitArgs(
            CriticWorker, cfg.model, cfg.critic, cfg.rollout.n, plugins=cfg.trainer.plugins
        )
    if "reward_model" in worker_set.roles:
        classes["reward_model"] = ClassWithInitArgs(RewardModelWorker, cfg.reward_model, plugins=cfg.trainer.plugins)
    if "teacher" in worker_set.roles:
        classes["teacher"] = ClassWithInitArgs(TeacherWorker, cfg.distillation.teacher, plugins=cfg.trainer.plugins)
    if "judge" in worker_set.roles:
        classes["judge"] = ClassWithInitArgs(JudgeWorker, cfg.judge, plugins=cfg.trainer.plugins)
    return classes


def _spawn(make_group, classes: dict[str, ClassWithInitArgs], pool) -> dict[str, WorkerGroup]:
    if len(classes) == 1:
        ((name, cls),) = classes.items()
        return {name: make_group(pool, cls)}
    return make_group(pool, create_colocated_worker_cls(classes)).spawn(classes)


def build_roles(run: ResolvedRun) -> Roles:
    """Create the resource pools and one worker group per worker set (colocated roles fused into one
    process); workers are constructed, models not yet loaded."""
    make_group, pools, release = group_factory(run.config.trainer, [s.world_size for s in run.worker_sets], "hf")
    groups = {}
    for worker_set in run.worker_sets:
        spawned = _spawn(make_group, _set_classes(run.config, worker_set), pools[worker_set.pool])
        groups.update({role: spawned[_CLASS_OF_ROLE[role]] for role in worker_set.roles})
    return Roles(
        groups["actor"],
        groups.get("ref"),
        groups.get("critic"),
        groups.get("reward_model"),
        groups["rollout"],
        release,
        teacher=groups.get("teacher"),
        judge=groups.get("judge"),
    )


def worker_timeouts(t: JobConfig) -> Timeouts:
    """The worker groups' timeouts from a resolved trainer section (the Ray backend applies them)."""
    return Timeouts(t.call_timeout_s, t.collective_timeout_s, "trainer.call_timeout_s")


def group_factory(t: JobConfig, set_sizes: list[int], name_prefix: str):
    """(make_group(pool, cls_with_init), [one pool per worker set of `set_sizes` ranks], release()) for
    trainer.backend; `release` frees the pools' placement (after the groups are shut down). Ray groups get
    the quiet-library env vars and the call/collective timeouts. Shared by every trainer."""
    if t.backend == "local":
        return (
            (lambda pool, cls: LocalWorkerGroup(pool, cls)),
            [LocalResourcePool(use_gpu=t.device == "cuda")],
            lambda: None,
        )
    from hybridflow.controller.ray import RayResourcePool, RayWorkerGroup, split_resource_pool  # noqa: PLC0415  (lazy: the local backend runs without Ray)

    pool = RayResourcePool(
        [t.n_workers_per_node] * t.nnodes,
        use_gpu=t.device == "cuda",
        num_cpus_per_process=t.cpus_per_worker,
        name_prefix=name_prefix,
    )
    pools = split_resource_pool(pool, set_sizes) if len(set_sizes) > 1 else [pool]
    env, timeouts = worker_env(t.verbose), worker_timeouts(t)
    return (lambda p, cls: RayWorkerGroup(p, cls, env_vars=env, timeouts=timeouts)), pools, pool.remove
