"""On-policy distillation: a teacher's per-token log-probs of the tokens the student sampled.

The student samples y ~ pi_s; the teacher scores the same token ids. Per token t the signal is a
single-sample estimate of the reverse KL, KL(pi_s || pi_t), named by a KL estimator of algos/kl.py
(`KL_ESTIMATORS`, with logprob = student, ref_logprob = teacher): k1 = log pi_s(y_t) - log pi_t(y_t)
is the plain log-prob gap, k3 ("low_var_kl") a non-negative one.

Two uses, chosen by distillation.signal:
- "advantage" (the Tinker cookbook's on-policy distillation, and verl's use_policy_gradient=true):
  the per-token advantage is -coef * reverse_kl, added to the rule reward's advantage (or alone); the
  policy loss then pushes up tokens the teacher likes more than the student does, token by token, with
  no baseline and no discounting (the cookbook's kl_discount_factor=0).
- "loss" (verl's use_policy_gradient=false, arXiv:2306.13649 style): coef * agg(reverse_kl) with the
  gradient through the student's log-probs is added to the policy loss. k1 is refused there: the
  gradient of log pi_s(y) on samples y ~ pi_s has mean zero whatever the teacher says.

Departures: verl's top-k losses (forward_kl_topk, jsd) need the teacher's top-k distributions, not only
the sampled token's log-prob, and are not offered. verl applies distillation_loss_coef only when task
rewards are used; here `coef` always scales the signal. Clamps follow verl: `log_prob_min_clamp`
bounds both log-probs from below before the estimate, `kl_clamp` bounds the estimate to [-c, c].
"""

from __future__ import annotations

from torch import Tensor

from hybridflow.algos.core import GlobalNorm, agg_loss, masked_mean
from hybridflow.algos.kl import KL_ESTIMATORS

SIGNALS = ("advantage", "loss")
"""Values of distillation.signal (module docstring)."""


def teacher_reverse_kl(
    student_log_prob: Tensor,
    teacher_log_prob: Tensor,
    estimator: str = "k1",
    log_prob_min_clamp: float | None = None,
    kl_clamp: float | None = None,
) -> Tensor:
    """Per-token estimate of KL(student || teacher) at the sampled tokens, [B, R] (module docstring)."""
    if log_prob_min_clamp is not None:
        student_log_prob = student_log_prob.clamp(min=log_prob_min_clamp)
        teacher_log_prob = teacher_log_prob.clamp(min=log_prob_min_clamp)
    kl = KL_ESTIMATORS.get(estimator)(student_log_prob, teacher_log_prob)
    return kl if kl_clamp is None else kl.clamp(-kl_clamp, kl_clamp)


def distillation_advantages(reverse_kl: Tensor, response_mask: Tensor, coef: float) -> Tensor:
    """The Tinker cookbook's per-token advantage -coef * reverse_kl, 0 where response_mask is 0 (padding and,
    multi-turn, observation tokens: they were not sampled by the student)."""
    return -coef * reverse_kl.detach() * response_mask.to(reverse_kl.dtype)


def distillation_loss(
    log_prob: Tensor,
    teacher_log_prob: Tensor,
    response_mask: Tensor,
    estimator: str,
    loss_agg_mode: str,
    global_norm: GlobalNorm | None = None,
    log_prob_min_clamp: float | None = None,
    kl_clamp: float | None = None,
) -> Tensor:
    """agg(reverse_kl) over the response tokens, differentiable through the student's `log_prob` (the teacher's
    is a constant); aggregated as the policy loss is (`loss_agg_mode`, `global_norm`)."""
    kl = teacher_reverse_kl(log_prob, teacher_log_prob.detach(), estimator, log_prob_min_clamp, kl_clamp)
    return agg_loss(kl, response_mask, loss_agg_mode, global_norm)


def distillation_metrics(student_log_prob: Tensor, teacher_log_prob: Tensor, response_mask: Tensor) -> dict:
    """What docs/guides/distillation.md explains, over the response tokens of the batch:
    teacher_kl: mean of log pi_s - log pi_t (k1: the per-token reverse KL estimate);
    student_log_prob / teacher_log_prob: mean log-prob of the sampled tokens under each;
    log_prob_gap_abs / log_prob_gap_max: mean and largest |log pi_s - log pi_t|."""
    mask = response_mask.bool()
    if not mask.any():
        return {}
    gap = (student_log_prob - teacher_log_prob).float()
    return {
        "distillation/teacher_kl": float(masked_mean(gap, response_mask)),
        "distillation/student_log_prob": float(masked_mean(student_log_prob.float(), response_mask)),
        "distillation/teacher_log_prob": float(masked_mean(teacher_log_prob.float(), response_mask)),
        "distillation/log_prob_gap_abs": float(masked_mean(gap.abs(), response_mask)),
        "distillation/log_prob_gap_max": float(gap.abs()[mask].max()),
    }
