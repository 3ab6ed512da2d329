"""The run as the planner sees it: a RunConfig -> planner/inputs.py `RunShape` (the planner never reads configs).

Also the rules both sides need: whether old log-probs take their own pass (`recompute_old_log_prob`), and
what actor.old_log_prob=auto resolves to (`old_log_prob_mode`).
"""

from __future__ import annotations

import torch

from hybridflow.config.run import RunConfig
from hybridflow.planner.inputs import RunShape


def recompute_old_log_prob(cfg: RunConfig, actor_world: int) -> bool:
    """Whether old log-probs need their own pass: yes unless they are the rollout's (actor.old_log_prob=rollout)
    or the update is a single optimizer step over the whole batch on every rank and nothing before the update
    needs them (KL in the reward, rollout IS, the distillation signal: the student's log-probs of its samples)."""
    a, rows = cfg.actor, cfg.data.train_batch_size * cfg.rollout.n
    if a.old_log_prob == "rollout":
        return False
    one_step = a.ppo_epochs == 1 and a.ppo_mini_batch_size >= cfg.data.train_batch_size and rows % actor_world == 0
    needs_old = cfg.algorithm.use_kl_in_reward or cfg.algorithm.rollout_is_threshold is not None
    needs_old = needs_old or cfg.distillation.enabled
    return a.old_log_prob == "recompute" or not one_step or needs_old


def old_log_prob_mode(cfg: RunConfig, actor_dp: int) -> str:
    """actor.old_log_prob of a config whose dtypes are resolved, with "auto" decided: "rollout" where the auto
    rule would recompute old log-probs only because the update takes several optimizer steps, and the rollout
    computes the trainer's numbers: the native rollout with fp32 weights and math beside an fp32 actor (gap_mean
    ~1e-5 on the main job, BENCHMARKS.md), in a synchronous run without adapters, tools or pipeline stages, with
    the parity guard on to check them at the update's first step. Anything else keeps the value it had."""
    a, r, alg = cfg.actor, cfg.rollout, cfg.algorithm
    if a.old_log_prob != "auto" or not recompute_old_log_prob(cfg, actor_dp):
        return a.old_log_prob
    needs_old = alg.use_kl_in_reward or alg.rollout_is_threshold is not None
    same_numbers = r.name == "native" and r.weight_dtype is None and a.engine.param_dtype == r.dtype == "fp32"
    checked = cfg.trainer.parity != "off" and r.calculate_log_probs is not False
    plain = cfg.trainer.mode == "sync" and not (
        a.lora.enabled or r.multi_turn.enable or a.engine.pipeline_model_parallel_size > 1
    )
    corrected = a.policy_loss.tis_imp_ratio_cap is not None
    return "rollout" if same_numbers and checked and plain and not (needs_old or corrected) else "auto"


def run_roles(cfg: RunConfig) -> tuple[str, ...]:
    """The planner's roles for a run config: the same roles config/resolve.py builds workers for."""
    return (
        ("actor_rollout",)
        + ("ref",) * cfg.use_ref
        + ("critic",) * cfg.use_critic
        + ("reward_model",) * bool(cfg.reward_model.enable)
    )  # the distillation teacher's forward is not priced yet (planner/cost.py)


def micro_rows(cfg: RunConfig) -> dict[str, float]:
    """Rows per micro-batch of each operator (0 where token budgets size them: left out of the count)."""
    a, c = cfg.actor, cfg.critic
    rows = {
        "update_actor": 0 if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_device,
        "old_log_prob": 0 if a.use_dynamic_bsz else a.log_prob_micro_batch_size_per_device,
        "ref_log_prob": 0 if cfg.ref.log_prob_use_dynamic_bsz else cfg.ref.log_prob_micro_batch_size_per_device,
        "update_critic": 0 if c.use_dynamic_bsz else c.ppo_micro_batch_size_per_device,
        "values": 0 if c.use_dynamic_bsz else c.ppo_micro_batch_size_per_device,
    }
    return {op: float(n) for op, n in rows.items() if n}


def fsdp_sharded(cfg: RunConfig) -> bool:
    """Whether the actor's FSDP shards the model over its workers (else each holds it whole: CPU's default)."""
    workers = max(1, cfg.world_size)
    return cfg.actor.engine.resolve_fsdp_size(torch.device(cfg.trainer.device), workers) > 1


def run_shape(cfg: RunConfig) -> RunShape:
    """The planner's description of `cfg` on its workers (trainer.n_workers_per_node set)."""
    a, d = cfg.actor, cfg.data
    return RunShape(
        roles=run_roles(cfg),
        workers=cfg.world_size,
        rows=d.train_batch_size * cfg.rollout.n,
        prompt_length=d.max_prompt_length,
        response_length=d.max_response_length,
        actor_epochs=a.ppo_epochs,
        critic_epochs=cfg.critic.ppo_epochs,
        optimizer_steps=d.train_batch_size / a.ppo_mini_batch_size * a.ppo_epochs,
        micro_rows=micro_rows(cfg),
        sharded=fsdp_sharded(cfg),
        recompute_old_log_prob=recompute_old_log_prob(cfg, cfg.world_size),
    )
