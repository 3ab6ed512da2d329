"""bench/plans.py's statistics against hand-computed values: Kendall tau over all pairs and over the pairs a
measurement orders, and which pairs those are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "plans.py"


@pytest.fixture(scope="module")
def plans():
    spec = importlib.util.spec_from_file_location("bench_plans", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tau_a_counts_every_pair(plans):
    assert plans.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert plans.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # one swapped pair of 6: (5 - 1) / 6
    assert plans.kendall_tau([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(4 / 6)


def test_tau_over_the_pairs_the_measurement_orders_leaves_ties_out(plans):
    # the swapped pair (2, 3) is unordered by the measurement: the 5 other pairs are all concordant
    assert plans.kendall_tau([1, 2, 3, 4], [10, 20, 40, 30], {(2, 3)}) == 1.0
    # a discordant ordered pair still counts against: (0, 1) left out, (2, 3) swapped -> (4 - 1) / 5
    assert plans.kendall_tau([1, 2, 3, 4], [10, 20, 40, 30], {(0, 1)}) == pytest.approx(3 / 5)
    assert plans.kendall_tau([1, 2], [5, 5.1], {(0, 1)}) == 1.0  # nothing left to order


def test_unseparated_uses_two_standard_errors_of_the_difference(plans):
    # s.e. of [9, 11, 10, 10] = stdev 0.816 / 2 = 0.408; of [10.5] * 4 = 0; 2 s.e. of the difference = 0.816
    steps = [[9, 11, 10, 10], [10.5] * 4, [12, 12, 12, 12]]
    assert plans.unseparated(steps) == {(0, 1)}  # 0.5 apart is within 0.816; 2.0 apart is not
    assert plans.unseparated(steps, z=5.0) == {(0, 1), (0, 2)}  # 5 s.e. = 2.04 > 2.0
