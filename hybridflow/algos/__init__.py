"""Pure tensor math of the RL algorithms: advantages, policy/value losses, KL, masked reductions.

No Ray, no torch.distributed, no I/O: everything here is a function of
tensors (and of counts passed in, see `GlobalNorm`). Estimators (with their
spec: needs a critic, groups, a baseline, sync mode), policy losses, KL
estimators and loss aggregation modes are registered by name. Register your own
with `@register_adv_est`, `@policy_loss` (a loss's per-token math),
`@register_policy_loss` (a loss of the full signature), `KL_ESTIMATORS.register`
or `LOSS_AGG_MODES.register` in a module listed in `trainer.plugins` (imported on
the controller before the config is checked and in every worker), or name it by
a `module:function` path in the config; docs/extending.md has an example of each.

Modules: core (masked reductions, loss aggregation), adv_spec (the estimator
contract and registry) and advantages (the built-in estimators), losses (the
policy losses: contract, registry, the shared finish step and the built-ins),
value_loss (the critic's loss), kl, logits, rollout_is. This package imports the
modules that register built-ins; no registry imports its own entries.
"""

from hybridflow.algos import advantages as _advantages  # noqa: F401  (registers the built-in estimators)
from hybridflow.algos.adv_spec import (
    get_advantage_estimator,
    list_advantage_estimators,
    register_adv_est,
)
from hybridflow.algos.core import (
    LOSS_AGG_MODES,
    GlobalNorm,
    agg_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridflow.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_loss,
    kl_penalty,
)
from hybridflow.algos.logits import entropy_from_logits, logprobs_from_logits
from hybridflow.algos.losses import (
    PolicyLossConfig,
    PolicyLossInputs,
    get_policy_loss_fn,
    list_policy_losses,
    policy_loss,
    register_policy_loss,
)
from hybridflow.algos.value_loss import compute_value_loss

__all__ = [
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "GlobalNorm",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "agg_loss",
    "apply_kl_penalty",
    "compute_value_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_loss",
    "kl_penalty",
    "list_advantage_estimators",
    "list_policy_losses",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "register_adv_est",
    "register_policy_loss",
]
