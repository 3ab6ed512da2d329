"""Rollout importance sampling (hybridflow/algos/rollout_is.py) against hand-computed values."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hybridflow.algos.losses import compute_policy_loss_vanilla
from hybridflow.algos.rollout_is import mismatch_metrics, rollout_importance_weights
from hybridflow.config.run import RunConfig
from hybridflow.config.trainer import AlgorithmConfig
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.train.core_steps import apply_rollout_is
from hybridflow.utils.config_loader import load_config

E = math.exp(0.5)  # 1.6487...

# Row 0: three tokens with log rho = old - rollout = 0, 0.5, -1; row 1: two tokens (0.5, 0) and one pad
# whose rollout log-prob (9.0) must never matter.
OLD = torch.tensor([[0.0, -1.0, -2.0], [0.5, 0.0, 0.0]])
ROLLOUT = torch.tensor([[0.0, -1.5, -1.0], [0.0, 0.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _weights(**kw) -> tuple[torch.Tensor, dict]:
    return rollout_importance_weights(OLD, ROLLOUT, MASK, **kw)


def test_token_truncate() -> None:
    w, m = _weights(level="token", mode="truncate", threshold=1.5)
    expected = torch.tensor([[1.0, 1.5, math.exp(-1)], [1.5, 1.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert m["mismatch/rollout_is_mean"] == pytest.approx((1 + 1.5 + math.exp(-1) + 1.5 + 1) / 5)
    assert m["mismatch/rollout_is_max"] == pytest.approx(1.5)
    assert m["mismatch/rollout_is_masked_fraction"] == 0.0
    # rho = e^0.5 twice above 1.5, e^-1 once below 1/1.5
    assert m["mismatch/rollout_is_outside_fraction"] == pytest.approx(3 / 5)


def test_token_mask_default_lower_is_reciprocal() -> None:
    w, m = _weights(level="token", mode="mask", threshold=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert m["mismatch/rollout_is_masked_fraction"] == pytest.approx(3 / 5)


def test_token_mask_explicit_lower() -> None:
    w, _ = _weights(level="token", mode="mask", threshold=2.0, threshold_lower=0.3)
    torch.testing.assert_close(w, torch.tensor([[1.0, E, math.exp(-1)], [E, 1.0, 0.0]]))


def test_sequence_truncate_and_mask() -> None:
    w, _ = _weights(level="sequence", mode="truncate", threshold=1.5)
    s0 = math.exp(-0.5)  # row 0: 0 + 0.5 - 1
    torch.testing.assert_close(w, torch.tensor([[s0, s0, s0], [1.5, 1.5, 0.0]]))
    w, m = _weights(level="sequence", mode="mask", threshold=1.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))  # 0.61 < 1/1.5, 1.65 > 1.5
    assert m["mismatch/rollout_is_masked_fraction"] == 1.0
    w, _ = _weights(level="sequence", mode="mask", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[s0, s0, s0], [E, E, 0.0]]))


def test_mismatch_metrics() -> None:
    m = mismatch_metrics(OLD, ROLLOUT, MASK)
    log_rho = [0.0, 0.5, -1.0, 0.5, 0.0]
    assert m["mismatch/kl"] == pytest.approx(-sum(log_rho) / 5)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_rho) / 5)
    assert m["mismatch/max_ratio"] == pytest.approx(E)
    assert m["mismatch/min_ratio"] == pytest.approx(math.exp(-1))
    same = mismatch_metrics(OLD, OLD, MASK)
    assert same["mismatch/kl"] == 0.0 and same["mismatch/k3_kl"] == 0.0 and same["mismatch/max_ratio"] == 1.0


def test_policy_loss_multiplies_the_weights() -> None:
    """ratio 1 (log_prob == old): the vanilla token loss is -A; weighted token-mean = -sum(A w) / valid tokens."""
    adv = torch.tensor([[1.0, 2.0, -1.0], [0.5, -2.0, 7.0]])
    w = torch.tensor([[1.0, 0.5, 0.0], [2.0, 1.0, 3.0]])
    loss, _ = compute_policy_loss_vanilla(OLD, OLD.clone(), adv, MASK, rollout_is_weights=w)
    assert float(loss) == pytest.approx(-(1.0 + 1.0 + 0.0 + 1.0 - 2.0) / 5)
    plain, _ = compute_policy_loss_vanilla(OLD, OLD.clone(), adv, MASK)
    assert float(plain) == pytest.approx(-(1.0 + 2.0 - 1.0 + 0.5 - 2.0) / 5)


def test_apply_rollout_is_on_a_batch() -> None:
    batch = DataProto.from_dict({K.OLD_LOG_PROBS: OLD, K.ROLLOUT_LOG_PROBS: ROLLOUT, K.RESPONSE_MASK: MASK})
    assert apply_rollout_is(batch, AlgorithmConfig()) == {}  # off by default: nothing added
    metrics = apply_rollout_is(batch, AlgorithmConfig(rollout_is_threshold=1.5))
    assert K.ROLLOUT_IS_WEIGHTS not in batch.batch.keys() and "mismatch/kl" in metrics  # metrics only (verl's default)
    apply_rollout_is(batch, AlgorithmConfig(rollout_is_threshold=1.5, rollout_is=True))
    torch.testing.assert_close(batch.batch[K.ROLLOUT_IS_WEIGHTS][1], torch.tensor([1.5, 1.0, 0.0]))
    no_rollout_log_probs = DataProto.from_dict({K.OLD_LOG_PROBS: OLD, K.RESPONSE_MASK: MASK})
    assert apply_rollout_is(no_rollout_log_probs, AlgorithmConfig(rollout_is_threshold=1.5)) == {}  # as verl


def test_a_threshold_without_rollout_log_probs_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    """verl's default config sets rollout_is_threshold=2.0 and calculate_log_probs=false: no metrics, no error."""
    with caplog.at_level(logging.WARNING, logger="hybridflow.config"):
        load_config(RunConfig, None, ["algorithm.rollout_is_threshold=2", "rollout.calculate_log_probs=false"])
    assert any("no mismatch/* metrics" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.rollout_is_threshold=0.9"], "must be > 1"),
        (["algorithm.rollout_is_threshold_lower=0.5"], "needs algorithm.rollout_is_threshold"),
        (["algorithm.rollout_is_threshold=2", "algorithm.rollout_is_level=geometric"], "rollout_is_level"),
        (["algorithm.rollout_is_threshold=2", "algorithm.rollout_is_mode=clip"], "rollout_is_mode"),
        (
            ["algorithm.rollout_is_threshold=2", "algorithm.rollout_is=true", "rollout.calculate_log_probs=false"],
            "rollout.calculate_log_probs=false",
        ),
    ],
)
def test_config_refuses(overrides: list[str], message: str) -> None:
    with pytest.raises(Exception, match=message):
        load_config(RunConfig, None, overrides)
