"""Advantage estimator specs and their registry (config: algorithm.adv_estimator).

An estimator is registered with what the trainer must know about it -- needs a critic, needs groups, computes a
baseline inside the step, runs in sync mode only -- so no trainer code branches on an estimator's name
(torchtitan's ModelSpec). This module is the contract the trainer and plugin authors program against and imports
no estimator; the built-ins are the math in advantages.py, registered when the `hybridflow.algos` package imports it.

Signature of an estimator (`AdvantageEstimatorFn`):

    fn(token_level_rewards [B, R], response_mask [B, R], index [B], *,
       values=None, reward_baselines=None, gamma=1.0, lam=1.0,
       norm_adv_by_std_in_grpo=True, epsilon=1e-6, **unused) -> (advantages [B, R], returns [B, R])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch import Tensor

from hybridflow.utils.registry import Registry


class AdvantageEstimatorFn(Protocol):
    """The uniform estimator signature the trainer calls by name (module docstring)."""

    def __call__(
        self, token_level_rewards: Tensor, response_mask: Tensor, index: np.ndarray, **kwargs: Any
    ) -> tuple[Tensor, Tensor]: ...


class BaselineContext(Protocol):
    """What an estimator's `baseline` may ask of the trainer within one step (train/core_steps.py has it)."""

    n: int
    """Samples per prompt in this step's batch (rollout.n)."""

    def generate_scores(self, *, do_sample: bool, n: int) -> Tensor:
        """Generate `n` responses per prompt of this step with the current weights, score them like the
        samples (rule + reward model) and return their sequence scores [P * n], a prompt's n adjacent."""
        ...


BaselineFn = Callable[[BaselineContext], Tensor]
"""ctx -> reward_baselines [P * rollout.n], one per sample, passed to the estimator as reward_baselines=."""


@dataclass(frozen=True)
class AdvantageEstimatorSpec:
    """An advantage estimator and what the trainer must know about it (no trainer code branches on names)."""

    fn: AdvantageEstimatorFn
    """The estimator (signature: `AdvantageEstimatorFn`)."""
    needs_critic: bool = False
    """It reads values= from a critic: the critic is built (unless critic.enable=false, which is refused)."""
    needs_groups: bool = False
    """Its baseline comes from the other samples of the same prompt: needs rollout.n > 1."""
    baseline: BaselineFn | None = None
    """Computes reward_baselines= in the scoring step (e.g. ReMax's greedy response); None: no baseline."""
    sync_only: bool = False
    """It needs the training weights inside the step (e.g. to generate a baseline): trainer.mode=sync only."""


def _as_spec(entry: Any) -> AdvantageEstimatorSpec:
    """A `module:attr` path may name a spec or a bare estimator function (then it needs nothing)."""
    return entry if isinstance(entry, AdvantageEstimatorSpec) else AdvantageEstimatorSpec(fn=entry)


ADV_ESTIMATORS: Registry[AdvantageEstimatorSpec] = Registry(
    "advantage estimator",
    "algorithm.adv_estimator",
    "add one with @hybridflow.algos.register_adv_est or give a module:function path",
    wrap=_as_spec,
)
"""Advantage estimator specs by name."""


def register_adv_est(
    name: str,
    *,
    needs_critic: bool = False,
    needs_groups: bool = False,
    baseline: BaselineFn | None = None,
    sync_only: bool = False,
    override: bool = False,
) -> Callable[[AdvantageEstimatorFn], AdvantageEstimatorFn]:
    """Decorator registering an estimator under `name` (config: algorithm.adv_estimator) with its spec's
    facts (see `AdvantageEstimatorSpec`); returns the function unchanged."""

    def add(fn: AdvantageEstimatorFn) -> AdvantageEstimatorFn:
        spec = AdvantageEstimatorSpec(fn, needs_critic, needs_groups, baseline, sync_only)
        ADV_ESTIMATORS.register(name, spec, override=override)
        return fn

    return add


def get_advantage_spec(name: str) -> AdvantageEstimatorSpec:
    """The spec registered under `name` (or loaded from a module:function path); unknown names raise."""
    return ADV_ESTIMATORS.get(name)


def get_advantage_estimator(name: str) -> AdvantageEstimatorFn:
    """The estimator function registered under `name`; unknown names raise with the valid list."""
    return ADV_ESTIMATORS.get(name).fn


def list_advantage_estimators() -> list[str]:
    """Sorted names of all registered estimators."""
    return ADV_ESTIMATORS.names()
