"""Token balancing across data-parallel workers and token-budget micro-batches, against hand-computed cases."""

import numpy as np
import pytest
import torch

from hybridflow.engine.batch import TokenBudget, split_micro_batches, token_bounds
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.train.balance import balance_batch, balanced_order


def _batch(lengths: list[int], uids: list[str]) -> DataProto:
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return DataProto.from_dict(
        {K.ATTENTION_MASK: mask, "row": torch.arange(len(lengths))}, non_tensors={K.UID: np.array(uids, dtype=object)}
    )


def test_groups_are_dealt_heaviest_first_to_the_lightest_worker():
    # groups of 2 rows: a=20, b=12, c=10, d=2 tokens -> worker 0 gets a+d = 22, worker 1 b+c = 22
    tokens = [10, 10, 6, 6, 5, 5, 1, 1]
    units = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert balanced_order(tokens, units, 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_balance_batch_keeps_groups_together_and_rows_equal():
    batch = _batch([10, 10, 6, 6, 5, 5, 1, 1], ["a", "a", "b", "b", "c", "c", "d", "d"])
    metrics = balance_batch(batch, 2)
    assert batch.batch["row"].tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert list(batch.non_tensor_batch[K.UID]) == ["a", "a", "d", "d", "b", "b", "c", "c"]
    assert metrics["perf/dp_token_imbalance_before"] == pytest.approx(32 / 22)
    assert metrics["perf/dp_token_imbalance"] == pytest.approx(1.0)


def test_rows_balance_alone_when_groups_cannot_split_evenly():
    batch = _batch([9, 1, 8, 2, 7, 3], ["a", "a", "a", "b", "b", "b"])  # 2 groups of 3 rows over 3 workers
    balance_batch(batch, 3)
    chunks = batch.batch[K.ATTENTION_MASK].sum(-1).view(3, 2).sum(-1).tolist()
    assert chunks == [10, 10, 10]


def test_token_budget_micro_batches_fill_in_order():
    assert token_bounds([10] * 8, 25) == [0, 2, 4, 6, 8]
    assert token_bounds([10, 50, 10, 10, 10, 10], 40) == [0, 1, 2, 6]  # a longer row goes alone
    data = {
        K.INPUT_IDS: torch.zeros(4, 5),
        K.ATTENTION_MASK: torch.tensor([[1] * 5, [1] * 2 + [0] * 3, [1] * 3 + [0] * 2, [1] * 5]),
    }
    assert [m[K.INPUT_IDS].shape[0] for m in split_micro_batches(data, TokenBudget(7))] == [2, 1, 1]
    assert [m[K.INPUT_IDS].shape[0] for m in split_micro_batches(data, 3)] == [3, 1]
