"""Loss functions of the actor and critic updates, built from the algorithm registries.

Each builder takes the config and returns a `LossBuilder`: given the mini-batch's
global counts it returns the per-micro-batch `loss_fn(outputs, micro)` that the
engine calls. Logged values are each micro-batch's own mean (not the globally
normalised share that is back-propagated).
"""

from __future__ import annotations

from hybridflow.algos.core import GlobalNorm, agg_loss, masked_mean
from hybridflow.algos.distillation import distillation_loss
from hybridflow.algos.kl import kl_loss
from hybridflow.algos.losses import get_policy_loss_fn
from hybridflow.algos.value_loss import compute_value_loss
from hybridflow.engine.base import LossFn, MicroBatch
from hybridflow.parity.logprob import logprob_gaps
from hybridflow.protocol import keys as K
from hybridflow.workers.config import ActorConfig, CriticConfig, DistillationConfig
from hybridflow.workers.ppo_update import LossBuilder, local_mean_factor


def actor_loss_builder(
    cfg: ActorConfig,
    own_old_log_prob: bool = False,
    parity_ratio: float | None = None,
    distillation: DistillationConfig | None = None,
) -> LossBuilder:
    """PPO-family policy loss (by name) - entropy_coeff * entropy + kl_loss_coef * KL(pi || ref)
    (+ distillation.coef * reverse KL(pi || teacher) with distillation.signal=loss, logged as `distillation_loss`).

    `own_old_log_prob`: the update is one optimizer step on the weights that generated
    (ActorConfig.old_log_prob), so the old log-probs are this forward's own, detached, and
    the entropy of the forward is logged as `entropy`. Else rows carry old_log_probs.
    With cfg.old_log_prob "rollout" the rows' old log-probs are the rollout's, and the first optimizer step
    (the first `build` call: still the weights that generated) is the on-policy forward instead; its entropy
    is logged as `entropy`.
    `parity_ratio` (with rollout log-probs): also log the log-prob parity numbers of the on-policy forward
    (parity/logprob.py) as `parity_gap_mean`, `parity_gap_max`, `parity_frac_beyond`.
    """
    policy_loss = get_policy_loss_fn(cfg.policy_loss_mode)
    mode = cfg.loss_agg_mode
    builds, from_rollout = [0], cfg.old_log_prob == "rollout"

    def build(gn: GlobalNorm) -> LossFn:
        on_policy = own_old_log_prob or (from_rollout and builds[0] == 0)
        builds[0] += 1

        def loss_fn(outputs: dict, micro: MicroBatch) -> tuple:
            mask = micro[K.RESPONSE_MASK]
            log_prob = outputs["log_probs"]
            old_log_prob = log_prob.detach() if own_old_log_prob else micro[K.OLD_LOG_PROBS]
            rollout_log_prob = micro.get(K.ROLLOUT_LOG_PROBS)
            pg_loss, stats = policy_loss(
                old_log_prob,
                log_prob,
                micro[K.ADVANTAGES],
                mask,
                loss_agg_mode=mode,
                config=cfg.policy_loss,
                global_norm=gn,
                rollout_log_probs=rollout_log_prob,
                rollout_is_weights=micro.get(K.ROLLOUT_IS_WEIGHTS),
            )
            scale = local_mean_factor(gn, mask, mode)
            metrics = {"pg_loss": float(pg_loss.detach()) * scale, **{k: float(v) for k, v in stats.items()}}
            # sampler vs trainer on the same tokens and weights (verl's name); old log-probs that are the rollout's
            # are compared through the first step's forward
            trainer_log_prob = log_prob.detach() if from_rollout else old_log_prob
            if rollout_log_prob is not None and (on_policy or not from_rollout):
                gap = (trainer_log_prob.exp() - rollout_log_prob.exp()).abs()
                metrics["rollout_probs_diff_mean"] = float(masked_mean(gap, mask))
            if on_policy and parity_ratio is not None and rollout_log_prob is not None:
                metrics.update(_parity_stats(log_prob.detach(), rollout_log_prob, mask, parity_ratio))
            if on_policy and outputs.get("entropy") is not None:  # computed with own old log-probs or entropy_coeff
                metrics["entropy"] = float(masked_mean(outputs["entropy"].detach(), mask))
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                entropy = agg_loss(outputs["entropy"], mask, mode, gn)
                loss = loss - cfg.entropy_coeff * entropy
                metrics["entropy_loss"] = float(entropy.detach()) * scale
            if cfg.use_kl_loss:
                kl = kl_loss(log_prob, micro[K.REF_LOG_PROB], mask, cfg.kl_loss_type, mode, gn)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["kl_loss"] = float(kl.detach()) * scale
            if distillation is not None and distillation.signal == "loss":
                d = distillation
                term = distillation_loss(
                    log_prob,
                    micro[K.TEACHER_LOG_PROBS],
                    mask,
                    d.estimator,
                    mode,
                    gn,
                    d.log_prob_min_clamp,
                    d.kl_clamp,
                )
                loss = loss + d.coef * term
                metrics["distillation_loss"] = float(term.detach()) * scale
            return loss, metrics

        return loss_fn

    return build


def _parity_stats(log_prob, rollout_log_prob, mask, ratio: float) -> dict[str, float]:
    gaps = logprob_gaps(log_prob, rollout_log_prob, mask, ratio)
    return {"parity_gap_mean": gaps.gap_mean, "parity_gap_max": gaps.gap_max, "parity_frac_beyond": gaps.frac_beyond}


def critic_loss_builder(cfg: CriticConfig) -> LossBuilder:
    """Clipped value loss against the returns (PPO)."""

    def build(gn: GlobalNorm) -> LossFn:
        def loss_fn(outputs: dict, micro: MicroBatch) -> tuple:
            mask = micro[K.RESPONSE_MASK]
            loss, clipfrac = compute_value_loss(
                outputs["values"],
                micro[K.RETURNS],
                micro[K.VALUES],
                mask,
                cfg.cliprange_value,
                cfg.loss_agg_mode,
                gn,
            )
            scale = local_mean_factor(gn, mask, cfg.loss_agg_mode)
            return loss, {"vf_loss": float(loss.detach()) * scale, "vf_clipfrac": float(clipfrac)}

        return loss_fn

    return build
