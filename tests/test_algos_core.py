"""Masked reductions, loss aggregation, chunked log-probs/entropy, and the import boundary of algos."""

import math
import subprocess
import sys

import pytest
import torch

from hybridflow.algos import (
    GlobalNorm,
    agg_loss,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridflow.algos.logits import _row_blocks

NAN = float("nan")
# valid entries 1, 2, 3 | 4, 5 ; padding holds NaN to prove it never leaks
VALUES = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 5.0, NAN, NAN]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_masked_sum_and_mean_ignore_nan_padding():
    assert masked_sum(VALUES, MASK).item() == 15.0
    assert masked_mean(VALUES, MASK).item() == 3.0  # 15 / 5
    assert masked_sum(VALUES, MASK, dim=-1).tolist() == [6.0, 9.0]
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == [2.0, 4.5]


def test_masked_var_unbiased_and_biased():
    # deviations from 3: -2 -1 0 1 2, squares sum to 10
    assert masked_var(VALUES, MASK).item() == pytest.approx(10 / 4)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(10 / 5)
    # per row: [1,2,3] -> var 1 ; [4,5] -> 0.5
    assert masked_var(VALUES, MASK, dim=-1).tolist() == pytest.approx([1.0, 0.5])


def test_masked_whiten_hand_values():
    out = masked_whiten(VALUES, MASK)
    std = math.sqrt(2.5)  # unbiased, from the test above
    expect = torch.tensor([[-2 / std, -1 / std, 0.0, 0.0], [1 / std, 2 / std, 0.0, 0.0]])
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=0)
    kept = masked_whiten(VALUES, MASK, shift_mean=False)
    torch.testing.assert_close(kept[MASK.bool()], expect[MASK.bool()] + 3.0, atol=1e-6, rtol=0)
    assert kept[~MASK.bool()].eq(0).all()


def test_empty_and_single_selections_give_zero_not_nan():
    empty = torch.zeros(2, 3, dtype=torch.long)
    x = torch.randn(2, 3)
    assert masked_mean(x, empty).item() == 0.0
    assert masked_var(x, empty).item() == 0.0
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert masked_var(x, one).item() == 0.0
    assert masked_whiten(x, one).abs().sum().item() == 0.0
    assert masked_mean(x, empty, dim=-1).tolist() == [0.0, 0.0]


# loss rows: [1 2 3 | pad], [4 | pad pad pad], and a row that is all padding (never counted)
LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [NAN] * 4])
LOSS_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 10 / 4),  # (1+2+3+4) / 4 tokens
        ("seq-mean-token-sum", (6 + 4) / 2),  # 2 valid sequences
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 / 4 + 4 / 4) / 2),  # norm length = width 4
    ],
)
def test_agg_loss_modes_by_hand(mode, expected):
    assert agg_loss(LOSS, LOSS_MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_norm_length_and_global_norm_by_hand():
    assert agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx((0.6 + 0.4) / 2)
    g = GlobalNorm(num_tokens=10, num_seqs=5, dp_size=2)
    assert agg_loss(LOSS, LOSS_MASK, "token-mean", g).item() == pytest.approx(10 / 10 * 2)
    assert agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum", g).item() == pytest.approx(10 / 5 * 2)
    assert agg_loss(LOSS, LOSS_MASK, "seq-mean-token-mean", g).item() == pytest.approx(6 / 5 * 2)


def test_agg_loss_gradient_is_zero_on_padding():
    loss = torch.tensor([[1.0, 2.0, 3.0, 7.0]], requires_grad=True)
    agg_loss(loss, torch.tensor([[1, 1, 0, 0]]), "token-mean").backward()
    assert loss.grad.tolist() == [[0.5, 0.5, 0.0, 0.0]]


def test_agg_loss_and_global_norm_reject_bad_input():
    with pytest.raises(ValueError, match="loss_agg_mode='mean' is not a registered loss aggregation mode.*token-mean"):
        agg_loss(LOSS, LOSS_MASK, "mean")
    with pytest.raises(ValueError, match="dp_size"):
        GlobalNorm(4, 2, 0)
    with pytest.raises(ValueError, match="num_tokens .* < num_seqs"):
        GlobalNorm(1, 2, 1)
    g = GlobalNorm.from_mask(LOSS_MASK, dp_size=3)
    assert (g.num_tokens, g.num_seqs, g.dp_size) == (4, 2, 3)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax_values_and_grads(chunk, dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    out = logprobs_from_logits(logits, labels, chunk_size=chunk)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    torch.testing.assert_close(out, ref)
    weights = torch.randn(3, 5, generator=gen)
    (grad,) = torch.autograd.grad((out * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_entropy_matches_categorical_values_and_grads(chunk):
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 7, 13, generator=gen)).requires_grad_()
    out = entropy_from_logits(logits, chunk_size=chunk)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(out, ref)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(grad, ref_grad)
    with torch.no_grad():
        torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk), ref)
    # uniform over 13 classes: entropy log 13
    assert entropy_from_logits(torch.zeros(1, 13)).item() == pytest.approx(math.log(13))


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_sliced_logits_are_read_in_place_with_the_same_results(chunk):
    """The engine passes logits[:, :-1]: a non-contiguous view that must not be copied whole."""
    gen = torch.Generator().manual_seed(2)
    full = (3 * torch.randn(3, 6, 11, generator=gen)).requires_grad_()
    sliced = full[:, :-1]
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    blocks = _row_blocks(sliced)
    assert all(b.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() for b in blocks)
    assert sum(len(b) for b in blocks) == 15
    dense = sliced.detach().clone().requires_grad_()
    for fn, args in ((logprobs_from_logits, (labels,)), (entropy_from_logits, ())):
        out, ref = fn(sliced, *args, chunk_size=chunk), fn(dense, *args, chunk_size=chunk)
        torch.testing.assert_close(out, ref)
        (grad,) = torch.autograd.grad(out.sum(), full)
        (ref_grad,) = torch.autograd.grad(ref.sum(), dense)
        torch.testing.assert_close(grad[:, :-1], ref_grad)
        assert not grad[:, -1].any()


def test_logits_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(2, 3), chunk_size=0)
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_import_algos_pulls_in_no_runtime():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import hybridflow.algos\n"
        "new = set(sys.modules) - before\n"
        "bad = [m for m in new if m.split('.')[0] == 'ray' or m.startswith(('torch.distributed', "
        "'hybridflow.workers', 'hybridflow.controller', 'hybridflow.train', 'hybridflow.cli', 'hybridflow.protocol'))]\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "assert not bad, bad\n"
        "print('ok', sorted(m for m in new if m.startswith('hybridflow')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "hybridflow.algos.losses" in res.stdout


def test_algos_sources_import_no_distributed_or_runtime_module():
    import ast
    import pathlib

    import hybridflow.algos as algos

    banned = (
        "torch.distributed",
        "ray",
        "hybridflow.workers",
        "hybridflow.controller",
        "hybridflow.train",
        "hybridflow.cli",
    )
    for path in pathlib.Path(algos.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                assert not any(name == b or name.startswith(b + ".") for b in banned), f"{path.name} imports {name}"
