"""The Tinker API's built-in losses (`forward_backward(loss_fn=...)`), one datum at a time, as sums.

Every loss has the signature

    fn(logprobs [T], inputs: dict[str, Tensor [T]], config: dict[str, float]) -> loss scalar

where `logprobs` are the trained model's log-probs of `inputs["target_tokens"]` (with grad) and `inputs`
holds the datum's other `loss_fn_inputs` as float tensors. The API sums the loss over tokens and datums
(no mean): a token with zero weight or zero advantage contributes nothing.

- cross_entropy: -sum(weights * logprobs) (negative weights are allowed: DPO sends them);
- importance_sampling: -sum(r * advantages), r = exp(logprobs - sampling logprobs);
- ppo: -sum(min(r * A, clip(r, low, high) * A)), config clip_low_threshold / clip_high_threshold (0.8 / 1.2);
- cispo: -sum(sg(clip(r, low, high)) * logprobs * A), same clip keys;
- dro: -sum(logprobs * A - beta / 2 * (logprobs - sampling logprobs)^2), config beta (required).

Each registered `TinkerLoss` says which inputs and config keys its loss reads (the service refuses anything else
by name), and which input, where zero, gives a token no gradient: the service computes those tokens' log-probs
without autograd (`grad_positions`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridflow.utils.registry import Registry

TinkerLossFn = Callable[[Tensor, dict[str, Tensor], dict[str, float]], Tensor]


@dataclass(frozen=True)
class TinkerLoss:
    """A loss, the `loss_fn_inputs` keys it needs (each a tensor as long as the datum's input) and the
    `loss_fn_config` keys it reads."""

    fn: TinkerLossFn
    inputs: tuple[str, ...]
    config_keys: tuple[str, ...] = ()
    grad_key: str | None = None
    """The input whose zero entries contribute no gradient at their token (weights, advantages); None: any token
    may contribute (dro's penalty reaches every token)."""

    def grad_positions(self, inputs: dict[str, Tensor]) -> Tensor:
        """Bool [T]: the tokens whose log-prob this loss can differentiate."""
        if self.grad_key is None:
            return torch.ones_like(next(iter(inputs.values())), dtype=torch.bool)
        return inputs[self.grad_key] != 0


TINKER_LOSSES: Registry[TinkerLoss] = Registry(
    "Tinker loss", "loss_fn", "the service serves cross_entropy, importance_sampling, ppo, cispo and dro"
)
"""Tinker's losses by their API name."""

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
"""What the policy-gradient losses take: the sampled tokens, their sampling log-probs and advantages."""
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
CLIP_LOW, CLIP_HIGH = 0.8, 1.2
"""Default ratio clip bounds of ppo and cispo."""


def register(name: str, inputs: tuple[str, ...], grad_key: str | None, config_keys: tuple[str, ...] = ()):
    """Decorator registering a loss function under its API `name` (`TinkerLoss` for the rest)."""

    def wrap(fn: TinkerLossFn) -> TinkerLossFn:
        TINKER_LOSSES.register(name, TinkerLoss(fn, inputs, config_keys, grad_key))
        return fn

    return wrap


def _ratio(logprobs: Tensor, sampling_logprobs: Tensor) -> Tensor:
    return torch.exp(logprobs - sampling_logprobs)


@register("cross_entropy", ("target_tokens", "weights"), "weights")
def cross_entropy(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum(weights * logprobs)."""
    return -(inputs["weights"] * logprobs).sum()


@register("importance_sampling", RL_INPUTS, "advantages")
def importance_sampling(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum(p / q * A): the policy gradient corrected for sampling from q."""
    return -(_ratio(logprobs, inputs["logprobs"]) * inputs["advantages"]).sum()


@register("ppo", RL_INPUTS, "advantages", CLIP_KEYS)
def ppo(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum(min(r * A, clip(r) * A)), the clipped surrogate."""
    ratio, adv = _ratio(logprobs, inputs["logprobs"]), inputs["advantages"]
    clipped = ratio.clamp(config.get("clip_low_threshold", CLIP_LOW), config.get("clip_high_threshold", CLIP_HIGH))
    return -torch.minimum(ratio * adv, clipped * adv).sum()


@register("cispo", RL_INPUTS, "advantages", CLIP_KEYS)
def cispo(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum(sg(clip(r)) * logprobs * A): the clipped ratio only weighs the log-likelihood gradient."""
    ratio = _ratio(logprobs, inputs["logprobs"]).detach()
    clipped = ratio.clamp(config.get("clip_low_threshold", CLIP_LOW), config.get("clip_high_threshold", CLIP_HIGH))
    return -(clipped * logprobs * inputs["advantages"]).sum()


@register("dro", RL_INPUTS, None, ("beta",))
def dro(logprobs: Tensor, inputs: dict[str, Tensor], config: dict[str, float]) -> Tensor:
    """-sum(logprobs * A - beta / 2 * (logprobs - sampling logprobs)^2)."""
    if "beta" not in config:
        raise ValueError("loss_fn='dro' needs loss_fn_config={'beta': ...} (the quadratic penalty's weight)")
    quad = (logprobs - inputs["logprobs"]).pow(2)
    return -(logprobs * inputs["advantages"] - 0.5 * config["beta"] * quad).sum()
