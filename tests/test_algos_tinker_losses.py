"""Each Tinker loss's `grad_positions` against autograd: the service computes the log-probs of the tokens it
leaves out without autograd, so a loss must have zero gradient at every one of them."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos.tinker_losses import TINKER_LOSSES

T = 12


def inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    zeros = torch.rand(T, generator=g) < 0.4
    if name == "cross_entropy":
        return {"weights": torch.randn(T, generator=g).masked_fill(zeros, 0.0)}
    return {
        "logprobs": -torch.rand(T, generator=g) * 3,
        "advantages": torch.randn(T, generator=g).masked_fill(zeros, 0.0),
    }


@pytest.mark.parametrize("name", sorted(TINKER_LOSSES.names()))
def test_a_loss_has_no_gradient_where_grad_positions_leaves_a_token_out(name):
    loss = TINKER_LOSSES.get(name)
    x = inputs(name)
    config = {"beta": 0.1} if "beta" in loss.config_keys else {}
    logprobs = (-torch.rand(T, generator=torch.Generator().manual_seed(1)) * 3).requires_grad_()
    (grad,) = torch.autograd.grad(loss.fn(logprobs, x, config), logprobs)
    kept = loss.grad_positions(x)
    assert kept.dtype == torch.bool and kept.shape == (T,)
    assert not grad[~kept].any(), (name, grad, kept)
    assert grad[kept].ne(0).any(), (name, grad, kept)
    if loss.grad_key is not None:
        assert (~kept).any()  # the inputs above leave some tokens out: the check is not vacuous
