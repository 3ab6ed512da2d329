"""measure + resolve in one call, as `hybridflow train` does, for tests about the resolved values."""

from hybridflow.config.measure import measure
from hybridflow.config.resolve import ResolvedRun, resolve
from hybridflow.config.run import RunConfig


def resolve_here(cfg: RunConfig, steps_per_epoch: int, cpu_count: int | None = None) -> ResolvedRun:
    """`resolve(cfg, steps_per_epoch, measure(cfg, cpu_count))`: this machine's measurements (cached probes)."""
    return resolve(cfg, steps_per_epoch, measure(cfg, cpu_count))
