"""Stop a run whose updates keep skipping their optimizer step.

The engine skips an optimizer step whose gradient norm is not finite (`update_skipped` = 1, engine/fsdp.py),
which protects the weights from one bad batch. When every step skips, the run goes on without learning; after
trainer.max_skipped_updates such steps in a row, `SkipGuard` stops it with one line naming the steps.
"""

from __future__ import annotations

from collections.abc import Mapping

SKIP_METRICS = ("actor/update_skipped", "critic/update_skipped", "train/update_skipped")
"""The step metrics that are > 0 when an update skipped an optimizer step (worker means over its steps):
PPO's actor and critic, SFT's train step."""


class SkippedUpdatesError(RuntimeError):
    """trainer.max_skipped_updates steps in a row skipped their update; one-line message."""


class SkipGuard:
    """Counts the steps in a row whose update skipped an optimizer step."""

    def __init__(self, limit: int) -> None:
        """`limit`: trainer.max_skipped_updates (0: never stop)."""
        self.limit = limit
        self.steps: list[int] = []

    def check(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """Record step `step`'s metrics; the reason to stop the run once the limit is reached, else None."""
        skipped = [key for key in SKIP_METRICS if metrics.get(key, 0.0) > 0]
        self.steps = [*self.steps, step] if skipped else []
        if not self.limit or len(self.steps) < self.limit:
            return None
        return (
            f"steps {self.steps[0]}-{self.steps[-1]}: {len(self.steps)} updates in a row skipped their optimizer "
            f"step ({skipped[0]} > 0: a non-finite gradient norm), so the run no longer learns; look for NaN or "
            "inf in the rewards (reward.non_finite) or the loss, lower the learning rate, or raise "
            "trainer.max_skipped_updates (0: never stop)"
        )
