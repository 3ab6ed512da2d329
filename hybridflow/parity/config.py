"""The parity guard's config: `trainer.parity` (what a breach does) and `trainer.parity_thresholds`.

`ParityFields` is a base of `TrainerConfig` (hybridflow/config/trainer.py), so the keys sit in the trainer
section as the issue names them (`trainer.parity=warn`) while their definitions and checks live here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.utils.config_loader import Section

PARITY_MODES = ("error", "warn", "off")
"""trainer.parity values."""
FREE_LOG_PROBS = ("native", "hf")
"""Rollout backends that compute the sampled tokens' log-probs anyway (returning them costs nothing)."""


@dataclass(frozen=True)
class Thresholds:
    """Resolved limits of the log-prob check (every field set)."""

    gap_mean: float
    gap_max: float
    ratio: float
    frac_beyond: float


DEFAULT_THRESHOLDS: dict[tuple[str, str], Thresholds] = {
    ("native", "fp32"): Thresholds(gap_mean=2e-4, gap_max=5e-3, ratio=0.2, frac_beyond=0.0),
    ("hf", "fp32"): Thresholds(gap_mean=2e-4, gap_max=5e-3, ratio=0.2, frac_beyond=0.0),
    ("native", "bf16"): Thresholds(gap_mean=0.15, gap_max=5.0, ratio=0.2, frac_beyond=0.1),
    ("hf", "bf16"): Thresholds(gap_mean=0.15, gap_max=5.0, ratio=0.2, frac_beyond=0.1),
}
"""(rollout.name, precision) -> defaults; precision is "bf16" when the rollout or the actor computes in bf16 or the
rollout holds bf16 weights (rollout.weight_dtype), else "fp32". fp32: about 10x (mean) and 100x (max) what healthy SmolLM2 runs measured; bf16: about 3x (mean, fraction
beyond) and 4x (max) the largest step of the main job's 40 healthy bf16 steps (docs/parity.md has the
measurements)."""
FALLBACK = ("native", "bf16")
"""The defaults of a backend / precision without its own entry (vllm, plugins): the loosest ones, bf16's."""


@dataclass
class ParityThresholds(Section):
    """When the log-prob parity check fires; a None field takes the measured default of the run's rollout
    backend and precision (`DEFAULT_THRESHOLDS`)."""

    gap_mean: float | None = None
    """Most allowed mean over the step's trained tokens of |log p_trainer - log p_rollout|, in nats."""
    gap_max: float | None = None
    """Most allowed |log p_trainer - log p_rollout| of any one trained token, in nats."""
    ratio: float | None = None
    """A token is "beyond" when |p_trainer / p_rollout - 1| exceeds this (0.2: the ratio leaves [0.8, 1.2])."""
    frac_beyond: float | None = None
    """Most allowed fraction (0..1) of the step's trained tokens beyond `ratio`."""

    def __post_init__(self) -> None:
        for name in ("gap_mean", "gap_max", "ratio", "frac_beyond"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # `not >=`: NaN fails too
                raise ValueError(f"trainer.parity_thresholds.{name} must be >= 0 or null, got {value}")
        if self.frac_beyond is not None and self.frac_beyond > 1:
            raise ValueError(f"trainer.parity_thresholds.frac_beyond is a fraction in [0, 1], got {self.frac_beyond}")

    def resolve(self, rollout_name: str, precision: str) -> Thresholds:
        """Every limit: this section's values, the measured defaults where it leaves them null."""
        default = DEFAULT_THRESHOLDS.get((rollout_name, precision), DEFAULT_THRESHOLDS[FALLBACK])
        mine = {k: getattr(self, k) for k in ("gap_mean", "gap_max", "ratio", "frac_beyond")}
        return Thresholds(**{k: getattr(default, k) if v is None else v for k, v in mine.items()})


@dataclass
class ParityFields(Section):
    """The trainer keys of the parity guard (hybridflow/parity/guard.py)."""

    parity: str = "error"
    """The parity guard (docs/parity.md): "error" stops the run at a step whose trained tokens are not the sampled
    ones, whose log-probs differ from the rollout's beyond trainer.parity_thresholds, or whose weight syncs
    reported a mismatch; "warn" logs the same message and goes on; "off" skips the checks (and the weight
    fingerprints, and the rollout log-probs that only the check asked for)."""
    parity_thresholds: ParityThresholds = field(default_factory=ParityThresholds)
    """Limits of the log-prob check; null fields: the measured defaults of the rollout backend and dtype."""

    def __post_init__(self) -> None:
        if str(self.parity).lower() == "false":  # YAML 1.1 reads an unquoted `off` (trainer.parity=off) as false
            self.parity = "off"
        if self.parity not in PARITY_MODES:
            raise ValueError(f"trainer.parity must be one of {list(PARITY_MODES)}, got {self.parity!r}")
        if isinstance(self.parity_thresholds, dict):
            self.parity_thresholds = ParityThresholds(**self.parity_thresholds)


def parity_rollout_fields(rollout: Any, parity: str, needs_log_probs: bool) -> dict[str, Any]:
    """The rollout fields the parity mode decides, for `dataclasses.replace` at resolve: calculate_log_probs
    where the config leaves it null (on where it is free or `needs_log_probs`, unless trainer.parity=off), and
    weight_fingerprints=False with trainer.parity=off."""
    out: dict[str, Any] = {}
    if rollout.calculate_log_probs is None:
        free = parity != "off" and rollout.name in FREE_LOG_PROBS
        out["calculate_log_probs"] = needs_log_probs or free
    if parity == "off":
        out["weight_fingerprints"] = False
    return out


def precision(*dtypes: str) -> str:
    """ "bf16" when any of the resolved compute dtypes is below fp32, else "fp32"."""
    return "fp32" if all(d == "fp32" for d in dtypes) else "bf16"
