"""Controller-side steps of the algorithm: KL penalty and advantages over a whole batch.

These glue the pure functions of hybridflow.algos to DataProto keys; the trainer
calls them between worker calls. No worker, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from hybridflow.algos.adv_spec import get_advantage_estimator, get_advantage_spec
from hybridflow.algos.distillation import distillation_advantages, distillation_metrics, teacher_reverse_kl
from hybridflow.algos.kl import apply_kl_penalty, get_kl_controller
from hybridflow.algos.rollout_is import mismatch_metrics, rollout_importance_weights
from hybridflow.config.trainer import AlgorithmConfig
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout.config import SamplingParams
from hybridflow.workers.config import DistillationConfig


def add_uids(prompts: DataProto, step: int) -> None:
    """Give every prompt its own group id; the n samples of a prompt inherit it through the rollout."""
    prompts.non_tensor_batch[K.UID] = np.array([f"{step}-{i}" for i in range(len(prompts))], dtype=object)


def make_kl_controller(cfg: AlgorithmConfig):
    """The KL-in-reward coefficient controller (fixed or adaptive)."""
    c = cfg.kl_ctrl
    return get_kl_controller(c.type, c.kl_coef, c.target_kl, c.horizon)


def apply_rewards(batch: DataProto, cfg: AlgorithmConfig, kl_ctrl) -> dict[str, float]:
    """token_level_rewards = scores (- beta * KL(pi_old || pi_ref) when use_kl_in_reward)."""
    scores = batch.batch[K.TOKEN_LEVEL_SCORES]
    if not cfg.use_kl_in_reward:
        batch.batch[K.TOKEN_LEVEL_REWARDS] = scores
        return {}
    rewards, metrics = apply_kl_penalty(
        scores,
        batch.batch[K.OLD_LOG_PROBS],
        batch.batch[K.REF_LOG_PROB],
        batch.batch[K.RESPONSE_MASK],
        kl_ctrl,
        cfg.kl_penalty,
    )
    batch.batch[K.TOKEN_LEVEL_REWARDS] = rewards
    return metrics


def apply_rollout_is(batch: DataProto, cfg: AlgorithmConfig) -> dict[str, float]:
    """Mismatch metrics between the sampler's and the trainer's log-probs, and (algorithm.rollout_is) the
    bounded IS weights `rollout_is_weights` [B, R] the policy loss multiplies in; {} when the threshold is unset or
    the batch has no rollout log-probs (rollout.calculate_log_probs=false: verl's behaviour)."""
    if cfg.rollout_is_threshold is None or K.ROLLOUT_LOG_PROBS not in batch.batch.keys():
        return {}
    old, rollout, mask = batch.batch[K.OLD_LOG_PROBS], batch.batch[K.ROLLOUT_LOG_PROBS], batch.batch[K.RESPONSE_MASK]
    weights, metrics = rollout_importance_weights(
        old,
        rollout,
        mask,
        cfg.rollout_is_level,
        cfg.rollout_is_mode,
        cfg.rollout_is_threshold,
        cfg.rollout_is_threshold_lower,
    )
    if cfg.rollout_is:
        batch.batch[K.ROLLOUT_IS_WEIGHTS] = weights
    return {**metrics, **mismatch_metrics(old, rollout, mask)}


def compute_advantage(batch: DataProto, cfg: AlgorithmConfig) -> None:
    """Fill `advantages` and `returns` [B, R] with the configured estimator."""
    estimator = get_advantage_estimator(cfg.adv_estimator)
    present = batch.batch.keys()
    advantages, returns = estimator(
        batch.batch[K.TOKEN_LEVEL_REWARDS],
        batch.batch[K.RESPONSE_MASK].float(),
        batch.non_tensor_batch[K.UID],
        values=batch.batch[K.VALUES] if K.VALUES in present else None,
        reward_baselines=batch.batch[K.REWARD_BASELINES] if K.REWARD_BASELINES in present else None,
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
    )
    batch.batch[K.ADVANTAGES] = advantages.float()
    batch.batch[K.RETURNS] = returns.float()


def apply_distillation(batch: DataProto, cfg: DistillationConfig) -> dict[str, float]:
    """After `compute_advantage`: the teacher's signal on the batch's advantages (hybridflow/algos/distillation.py),
    and the distillation metrics of the student's log-probs before the update (old_log_probs) against the
    teacher's. Task advantages are zeroed without use_task_rewards; signal=advantage adds -coef * reverse_kl per
    response token (observation tokens of multi-turn rows, which response_mask leaves out, get none);
    signal=loss leaves the advantages to the actor's loss term."""
    student, teacher = batch.batch[K.OLD_LOG_PROBS], batch.batch[K.TEACHER_LOG_PROBS]
    mask = batch.batch[K.RESPONSE_MASK]
    metrics = distillation_metrics(student, teacher, mask)
    if not cfg.use_task_rewards:
        batch.batch[K.ADVANTAGES] = torch.zeros_like(batch.batch[K.ADVANTAGES])
    if cfg.signal == "advantage":
        kl = teacher_reverse_kl(student, teacher, cfg.estimator, cfg.log_prob_min_clamp, cfg.kl_clamp)
        extra = distillation_advantages(kl, mask, cfg.coef)
        batch.batch[K.ADVANTAGES] = batch.batch[K.ADVANTAGES] + extra
        if mask.any():
            metrics["distillation/advantage_mean"] = float(extra.sum() / mask.sum())
    return metrics


@dataclass
class StepBaselineContext:
    """`BaselineContext` of one step: generates for this step's prompts with the current weights."""

    roles: Any
    """The run's worker groups (actor_rollout generates, reward_model scores if present)."""
    prompts: DataProto
    """This step's prompts, one row per prompt."""
    reward_fn: Callable[[DataProto], Any]
    """The run's reward function (returns an object with token_level_scores [B, R])."""
    n: int
    """Samples per prompt (rollout.n)."""
    sampling: SamplingParams
    """The run's training sampling params (rollout.*); a baseline's call changes do_sample and n only."""

    def generate_scores(self, *, do_sample: bool, n: int) -> torch.Tensor:
        """Generate n responses per prompt and score them like the samples: rule score plus the reward
        model's, if the run has one; returns sequence scores [P * n]."""
        step = self.prompts.meta_info[K.META_GLOBAL_STEP]  # reseed as the sampled call did: validation continues
        sampling = replace(self.sampling, do_sample=do_sample, n=n)
        out = self.roles.actor_rollout.generate_sequences(self.prompts, step=step, sampling=sampling)
        out.meta_info.pop(K.META_METRICS, None)
        if self.roles.reward_model is not None:
            out.union(self.roles.reward_model.compute_rm_score(out))
        return self.reward_fn(out).token_level_scores.sum(-1).float()


def has_baseline(cfg: AlgorithmConfig) -> bool:
    """Whether the configured estimator computes reward_baselines in the scoring step."""
    return get_advantage_spec(cfg.adv_estimator).baseline is not None


def reward_baselines(
    cfg: AlgorithmConfig, roles, prompts: DataProto, reward_fn, sampling: SamplingParams
) -> torch.Tensor:
    """The estimator's reward_baselines [P * n] for this step (its spec's `baseline`, e.g. ReMax's greedy reward)."""
    baseline = get_advantage_spec(cfg.adv_estimator).baseline
    if baseline is None:
        raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator} has no baseline; check has_baseline first")
    return baseline(StepBaselineContext(roles, prompts, reward_fn, sampling.n, sampling))


def pass_at_n(uids: np.ndarray, scores: torch.Tensor) -> float:
    """Share of prompts with at least one response scoring > 0.5 (pass@n, n = samples per prompt)."""
    best: dict[str, float] = {}
    for uid, s in zip(uids, scores.tolist()):
        best[uid] = max(best.get(uid, float("-inf")), s)
    return float(np.mean([v > 0.5 for v in best.values()])) if best else 0.0
