"""Preference losses against TRL's DPOTrainer formulas (trl 1.16.0 `_compute_loss`; cDPO as TRL computed
`loss_type="sigmoid"` with label_smoothing before 1.0), computed here by hand with plain `math` on stored inputs."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos.dpo import PREFERENCE_LOSSES, DPOLossConfig, PairLogps, dpo_loss

# Stored inputs: 4 pairs of summed response log-probs (policy and reference) and response token counts.
CHOSEN = [-12.5, -3.25, -40.0, -7.0]
REJECTED = [-14.0, -2.5, -39.0, -7.0]
REF_CHOSEN = [-13.0, -3.0, -41.5, -6.5]
REF_REJECTED = [-13.5, -3.5, -38.0, -8.0]
CHOSEN_TOKENS = [5, 2, 17, 3]
REJECTED_TOKENS = [6, 2, 15, 4]


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def expected(loss_type: str, beta: float, eps: float, reference_free: bool) -> tuple[float, dict[str, float]]:
    """The batch-mean loss and TRL's metrics, pair by pair in plain Python."""
    losses, cr, rr = [], [], []
    for i in range(len(CHOSEN)):
        rc = 0.0 if reference_free else REF_CHOSEN[i]
        rj = 0.0 if reference_free else REF_REJECTED[i]
        c, r = CHOSEN[i] - rc, REJECTED[i] - rj
        z = c - r
        if loss_type == "sigmoid":
            loss = -(1 - eps) * logsigmoid(beta * z) - eps * logsigmoid(-beta * z)
        elif loss_type == "robust":
            loss = (-(1 - eps) * logsigmoid(beta * z) + eps * logsigmoid(-beta * z)) / (1 - 2 * eps)
        elif loss_type == "hinge":
            loss = max(0.0, 1 - beta * z)
        else:  # ipo: log-ratios averaged over each response's tokens
            zn = c / CHOSEN_TOKENS[i] - r / REJECTED_TOKENS[i]
            loss = (zn - 1 / (2 * beta)) ** 2
        losses.append(loss)
        cr.append(beta * c)
        rr.append(beta * r)
    n = len(losses)
    stats = {
        "rewards/chosen": sum(cr) / n,
        "rewards/rejected": sum(rr) / n,
        "rewards/margins": sum(a - b for a, b in zip(cr, rr)) / n,
        "rewards/accuracies": sum(a > b for a, b in zip(cr, rr)) / n,
        "logps/chosen": sum(CHOSEN) / n,
        "logps/rejected": sum(REJECTED) / n,
    }
    return sum(losses) / n, stats


def stored_logps() -> PairLogps:
    t = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    return PairLogps(
        t(CHOSEN),
        t(REJECTED),
        t(CHOSEN_TOKENS),
        t(REJECTED_TOKENS),
        ref_chosen=t(REF_CHOSEN),
        ref_rejected=t(REF_REJECTED),
    )


CASES = [
    ("sigmoid", 0.1, 0.0, False),
    ("sigmoid", 0.5, 0.0, False),
    ("sigmoid", 0.1, 0.2, False),  # cDPO
    ("sigmoid", 0.1, 0.0, True),  # reference-free
    ("robust", 0.3, 0.1, False),
    ("hinge", 0.1, 0.0, False),
    ("hinge", 2.0, 0.0, False),  # some pairs past the hinge: zero loss
    ("hinge", 0.05, 0.0, True),
    ("ipo", 0.1, 0.0, False),
    ("ipo", 1.0, 0.0, True),
]


@pytest.mark.parametrize("loss_type, beta, eps, reference_free", CASES)
def test_loss_and_stats_equal_trl_formulas(loss_type: str, beta: float, eps: float, reference_free: bool) -> None:
    cfg = DPOLossConfig(loss_type=loss_type, beta=beta, label_smoothing=eps, reference_free=reference_free)
    loss, stats = dpo_loss(stored_logps(), cfg)
    want_loss, want_stats = expected(loss_type, beta, eps, reference_free)
    assert loss.item() == pytest.approx(want_loss, abs=1e-5)
    assert set(stats) == set(want_stats)
    for key, value in want_stats.items():
        assert stats[key].item() == pytest.approx(value, abs=1e-5), key
        assert not stats[key].requires_grad


def test_hinge_case_has_pairs_on_both_sides_of_the_hinge() -> None:
    margins = [2.0 * ((c - rc) - (r - rr)) for c, r, rc, rr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)]
    assert any(m > 1 for m in margins) and any(m < 1 for m in margins)


def test_global_pair_count_divides_the_sum_and_gradients_flow() -> None:
    logps = stored_logps()
    chosen = logps.chosen.clone().requires_grad_(True)
    logps = PairLogps(
        chosen, logps.rejected, logps.chosen_tokens, logps.rejected_tokens, logps.ref_chosen, logps.ref_rejected
    )
    cfg = DPOLossConfig()
    mean, _ = dpo_loss(logps, cfg)
    over_ten, _ = dpo_loss(logps, cfg, num_pairs=10)
    assert over_ten.item() == pytest.approx(mean.item() * 4 / 10, rel=1e-6)
    over_ten.backward()
    # d/dc of -log sigmoid(beta z) = -beta * sigmoid(-beta z), divided by the 10 pairs
    z = [(c - rc) - (r - rr) for c, r, rc, rr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)]
    want = [-0.1 / (1 + math.exp(0.1 * zi)) / 10 for zi in z]
    assert chosen.grad.tolist() == pytest.approx(want, abs=1e-7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beta": 0.0}, "dpo.beta must be > 0"),
        ({"loss_type": "kto"}, "dpo.loss_type='kto' is not a registered preference loss; known: hinge, ipo"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, "does not apply to dpo.loss_type=hinge"),
        ({"label_smoothing": 0.6}, r"must be in \[0, 0.5\] for dpo.loss_type=sigmoid"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, r"must be in \[0, 0.5\) for dpo.loss_type=robust"),
    ],
)
def test_bad_config_fails_naming_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DPOLossConfig(**kwargs)


def test_missing_reference_is_refused() -> None:
    logps = stored_logps()
    bare = PairLogps(logps.chosen, logps.rejected, logps.chosen_tokens, logps.rejected_tokens)
    with pytest.raises(ValueError, match="reference log-probs are missing"):
        dpo_loss(bare, DPOLossConfig())


def test_registered_names() -> None:
    assert {"sigmoid", "ipo", "hinge", "robust"} <= set(PREFERENCE_LOSSES.names())
