"""What the planner knows of a run: plain values, filled in by the trainer (config/plan_inputs.py).

The planner never reads a run config: the trainer describes the run as a `RunShape` (its roles, workers,
batch and the few engine facts the cost model prices) and asks the planner for a plan or a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLANNER_ROLES = ("actor_rollout", "ref", "critic", "reward_model")
"""The roles a plan places (actor and rollout share their weights, so they are one role here)."""


@dataclass(frozen=True)
class RunShape:
    """One layout of a run as the planner sees it."""

    roles: tuple[str, ...]
    """The run's roles, a subsequence of PLANNER_ROLES (actor_rollout first)."""
    workers: int
    """Worker processes (devices) of the run: trainer.n_workers_per_node * trainer.nnodes."""
    rows: int
    """Samples per training step: data.train_batch_size * rollout.n."""
    prompt_length: int
    """Tokens per prompt at most (data.max_prompt_length)."""
    response_length: int
    """Tokens per response at most (data.max_response_length)."""
    actor_epochs: int = 1
    """Passes of the actor update over the batch (actor.ppo_epochs)."""
    critic_epochs: int = 1
    """Passes of the critic update over the batch (critic.ppo_epochs)."""
    optimizer_steps: float = 1.0
    """Optimizer steps of the actor per training step: mini-batches x PPO epochs."""
    micro_rows: dict[str, float] = field(default_factory=dict)
    """Rows per micro-batch of each operator (operators sized by token budgets left out)."""
    sharded: bool = False
    """Whether the actor's FSDP shards the model over its workers (else each holds it whole)."""
    recompute_old_log_prob: bool = True
    """Whether old log-probs take their own forward pass before the update."""

    @property
    def use_ref(self) -> bool:
        """The run has a reference policy."""
        return "ref" in self.roles

    @property
    def use_critic(self) -> bool:
        """The run has a critic."""
        return "critic" in self.roles


def forward_ops(shape: RunShape) -> tuple[str, ...]:
    """The forward operators a step runs besides generation (a colocated run times them as one phase)."""
    ops = ("old_log_prob",) if shape.recompute_old_log_prob else ()
    return ops + ("ref_log_prob",) * shape.use_ref + ("values",) * shape.use_critic


def needed_ops(shape: RunShape) -> tuple[str, ...]:
    """The per-token operators a step of this run executes."""
    return (
        ("generate", "update_actor")
        + forward_ops(shape)
        + ("update_critic",) * shape.use_critic
        + ("rm_score",) * ("reward_model" in shape.roles)
    )
