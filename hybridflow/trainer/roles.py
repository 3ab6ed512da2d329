"""Roles -> resource pools -> worker groups, as the config's placement says.

- colocate (default): every role lives in every worker process (one process per
  device); the actor/rollout/ref, critic and reward model share memory and the
  process group, and run one after another.
- split: the policy (actor + rollout) gets the first half of the workers, the
  critic, reference and reward model the second half, so their calls overlap
  (the trainer issues them non-blocking).

The same code builds Ray worker groups or, with trainer.backend=local, one
in-process worker for debugging.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.controller.colocate import create_colocated_worker_cls
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.controller.worker_group import WorkerGroup
from hybridflow.trainer.run_config import RunConfig
from hybridflow.utils.quiet import worker_env
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker


@dataclass
class Roles:
    """The worker groups the trainer calls; ref/critic/reward_model are None when unused."""

    actor_rollout: WorkerGroup
    """Generates, computes old log-probs, updates the policy."""
    ref: WorkerGroup | None = None
    """Reference log-probs (may drive the same processes as actor_rollout)."""
    critic: WorkerGroup | None = None
    """Values and critic updates."""
    reward_model: WorkerGroup | None = None
    """Model-based reward scores."""

    def all(self) -> list[WorkerGroup]:
        """Distinct groups, for init/shutdown."""
        groups = [self.actor_rollout, self.ref, self.critic, self.reward_model]
        return list({id(g): g for g in groups if g is not None}.values())


def _role_classes(cfg: RunConfig, policy_role: str) -> dict[str, ClassWithInitArgs]:
    classes = {"policy": ClassWithInitArgs(ActorRolloutRefWorker, cfg.model, cfg.actor, cfg.rollout, cfg.ref, policy_role)}
    if cfg.use_critic:
        classes["critic"] = ClassWithInitArgs(CriticWorker, cfg.model, cfg.critic, cfg.rollout.n)
    if cfg.reward_model.enable:
        classes["rm"] = ClassWithInitArgs(RewardModelWorker, cfg.reward_model)
    return classes


def _spawn(make_group, classes: dict[str, ClassWithInitArgs], pool) -> dict[str, WorkerGroup]:
    if len(classes) == 1:
        (role, cls), = classes.items()
        return {role: make_group(pool, cls)}
    return make_group(pool, create_colocated_worker_cls(classes)).spawn(classes)


def build_roles(cfg: RunConfig) -> Roles:
    """Create the resource pools and worker groups; workers are constructed, models not yet loaded."""
    make_group, pools = _backend(cfg)
    if cfg.trainer.placement == "colocate":
        role = "actor_rollout_ref" if cfg.use_ref else "actor_rollout"
        groups = _spawn(make_group, _role_classes(cfg, role), pools[0])
        policy = groups["policy"]
        return Roles(policy, policy if cfg.use_ref else None, groups.get("critic"), groups.get("rm"))
    policy = make_group(pools[0], ClassWithInitArgs(ActorRolloutRefWorker, cfg.model, cfg.actor, cfg.rollout, cfg.ref, "actor_rollout"))
    others = _role_classes(cfg, "ref")
    if not cfg.use_ref:
        others.pop("policy")
    groups = _spawn(make_group, others, pools[1])
    return Roles(policy, groups.get("policy"), groups.get("critic"), groups.get("rm"))


def _backend(cfg: RunConfig):
    """(make_group(pool, cls_with_init), [pools]) for the configured backend and placement."""
    t = cfg.trainer
    if t.backend == "local":
        from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup

        return (lambda pool, cls: LocalWorkerGroup(pool, cls)), [LocalResourcePool()]
    from hybridflow.controller.ray import RayResourcePool, RayWorkerGroup, split_resource_pool

    pool = RayResourcePool([t.n_workers_per_node] * t.nnodes, use_gpu=t.device == "cuda",
                           num_cpus_per_process=t.cpus_per_worker, name_prefix="hf")
    pools = [pool]
    if t.placement == "split":
        first = cfg.world_size // 2
        pools = split_resource_pool(pool, [first, cfg.world_size - first])
    env = worker_env(t.verbose)
    return (lambda p, cls: RayWorkerGroup(p, cls, env_vars=env)), pools
