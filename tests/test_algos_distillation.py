"""On-policy distillation math (hybridflow/algos/distillation.py, train/core_steps.py apply_distillation) against
values computed by hand: the reverse-KL estimates, the Tinker-style advantage, the loss term, the metrics, and a
multi-turn row whose observation tokens carry no signal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.algos.distillation import (
    distillation_advantages,
    distillation_loss,
    distillation_metrics,
    teacher_reverse_kl,
)
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.train.core_steps import apply_distillation
from hybridflow.workers.config import DistillationConfig, TeacherConfig

STUDENT = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -4.0, -1.0, -1.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-0.1, -6.0, -2.0, -1.0]])
# row 1: columns 1-2 are a tool's reply (observation: attention 1, response_mask 0), column 3 the model again
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 1]])


def test_reverse_kl_estimators_by_hand():
    k1 = teacher_reverse_kl(STUDENT, TEACHER, "k1")
    assert k1[0].tolist() == [0.5, -1.0, 0.0, 6.0]
    k3 = teacher_reverse_kl(STUDENT, TEACHER, "k3")
    log_r = -0.5  # teacher - student at [0, 0]
    assert k3[0, 0].item() == pytest.approx(math.exp(log_r) - 1 - log_r)
    assert (k3 >= 0).all()
    k2 = teacher_reverse_kl(STUDENT, TEACHER, "k2")
    assert k2[0, 1].item() == pytest.approx(0.5)
    clamped = teacher_reverse_kl(STUDENT, TEACHER, "k1", log_prob_min_clamp=-5.0, kl_clamp=1.5)
    assert clamped[0].tolist() == [0.5, -1.0, 0.0, 1.5]  # teacher -9 -> -5, then 3 -> 1.5
    assert clamped[1, 1].item() == pytest.approx(1.0)  # student -4, teacher -6 -> -5: 1.0


def test_advantage_is_minus_coef_times_reverse_kl_on_sampled_tokens_only():
    adv = distillation_advantages(teacher_reverse_kl(STUDENT, TEACHER), MASK, coef=2.0)
    expected = torch.tensor([[-1.0, 2.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_loss_term_aggregates_like_the_policy_loss_and_its_gradient_reaches_the_student_only():
    student = STUDENT.clone().requires_grad_(True)
    teacher = TEACHER.clone().requires_grad_(True)
    loss = distillation_loss(student, teacher, MASK, "k3", "token-mean")
    k3 = teacher_reverse_kl(STUDENT, TEACHER, "k3")
    assert loss.item() == pytest.approx(float((k3 * MASK).sum() / MASK.sum()))
    loss.backward()
    assert teacher.grad is None
    # d k3 / d logp_s = 1 - exp(logp_t - logp_s), over 5 tokens
    grad = (1 - torch.exp(TEACHER - STUDENT)) * MASK / MASK.sum()
    torch.testing.assert_close(student.grad, grad)


def test_metrics_by_hand():
    m = distillation_metrics(STUDENT, TEACHER, MASK)
    gaps = [0.5, -1.0, 0.0, -0.1, 0.0]  # the five sampled tokens, student - teacher
    assert m["distillation/teacher_kl"] == pytest.approx(np.mean(gaps))
    assert m["distillation/log_prob_gap_abs"] == pytest.approx(np.mean(np.abs(gaps)))
    assert m["distillation/log_prob_gap_max"] == pytest.approx(1.0)
    assert m["distillation/student_log_prob"] == pytest.approx(np.mean([-1.0, -2.0, -0.5, -0.2, -1.0]))
    assert m["distillation/teacher_log_prob"] == pytest.approx(np.mean([-1.5, -1.0, -0.5, -0.1, -1.0]))
    assert distillation_metrics(STUDENT, TEACHER, torch.zeros_like(MASK)) == {}


def _batch(advantages: torch.Tensor) -> DataProto:
    return DataProto.from_dict(
        {
            K.OLD_LOG_PROBS: STUDENT,
            K.TEACHER_LOG_PROBS: TEACHER,
            K.RESPONSE_MASK: MASK,
            K.ATTENTION_MASK: torch.ones_like(MASK),
            K.ADVANTAGES: advantages,
        }
    )


def _cfg(**kw) -> DistillationConfig:
    return DistillationConfig(enabled=True, teacher=TeacherConfig(path="default"), **kw)


def test_apply_distillation_adds_to_the_task_advantage_and_skips_observation_tokens():
    task = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, 0.0, 0.0, -1.0]])
    batch = _batch(task.clone())
    metrics = apply_distillation(batch, _cfg(coef=0.5))
    kl = STUDENT - TEACHER
    torch.testing.assert_close(batch.batch[K.ADVANTAGES], task - 0.5 * kl * MASK)
    assert batch.batch[K.ADVANTAGES][1, 1:3].tolist() == [0.0, 0.0]  # the tool's reply: no signal
    assert metrics["distillation/advantage_mean"] == pytest.approx(-0.5 * float((kl * MASK).sum()) / 5)

    alone = _batch(task.clone())
    apply_distillation(alone, _cfg(use_task_rewards=False))
    torch.testing.assert_close(alone.batch[K.ADVANTAGES], -kl * MASK)

    as_loss = _batch(task.clone())
    metrics = apply_distillation(as_loss, _cfg(signal="loss"))
    torch.testing.assert_close(as_loss.batch[K.ADVANTAGES], task)  # the loss term is the actor's (workers/losses.py)
    assert "distillation/advantage_mean" not in metrics and "distillation/teacher_kl" in metrics
