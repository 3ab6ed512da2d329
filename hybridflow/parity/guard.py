"""`ParityGuard`: the controller's per-step check that the trainer trains what the rollout sampled.

The trainer calls `before_update(batch, step)` once the batch holds its old log-probs, and `after_update` with the
update's outputs. Three checks (docs/parity.md):
- weights: the findings the workers put in the generated batch's meta_info[keys.META_PARITY] (weight syncs whose
  fingerprints differ, parity/fingerprint.py);
- tokens: each row's trained ids (the response columns of input_ids, which the update reads, where response_mask
  is 1) against the hash of the ids the sampler drew (keys.SAMPLED_IDS_HASH, parity/tokens.py); a batch without
  that key (a plugin backend's) reports parity/token_checked_rows = 0;
- log-probs: rollout_log_probs against old_log_probs (parity/logprob.py) before the update. Where the step plan
  skips old log-probs (one optimizer step), the update's own forward computes the same numbers on its workers
  (`actor/parity_*`, workers/losses.py): the check then runs in `after_update`, after that one optimizer step
  (the run still stops at this step, before its checkpoint); there gap_mean and frac_beyond are means over
  micro-batches and ranks of each micro-batch's value, gap_max the largest. Without rollout log-probs
  (rollout.calculate_log_probs=false) the check is skipped, with parity/logprob_checked = 0 and one warning.
A breach raises `ParityError` (trainer.parity=error) or logs a warning (warn) naming the check, the step and the
usual cause; trainer.parity=off runs nothing and logs no parity/* metric.
"""

from __future__ import annotations

import logging
from typing import Any

from hybridflow import keys as K
from hybridflow.parity import ParityError
from hybridflow.parity.config import Thresholds, precision
from hybridflow.parity.logprob import LogprobGaps, logprob_gaps
from hybridflow.parity.tokens import mismatched_rows
from hybridflow.protocol import DataProto

log = logging.getLogger("hybridflow")

CAUSES = {
    "weights": "a weight sync left the rollout with other weights than the trainer's (a skipped or partial "
    "sync, a wrong dtype cast, a reshard into the wrong shard)",
    "tokens": "the trained ids are not the ones the model sampled: text decoded and re-tokenized, a chat template "
    "adding tokens the model did not sample with response_mask 1, a truncation or padding that shifted the "
    "response, or rows reordered in one key but not in another",
    "logprobs": "the rollout does not sample from the model the trainer scores: stale or wrongly cast rollout "
    "weights (see parity/weight_findings), another temperature on either side, top-k/top-p log-probs "
    "renormalised by the backend (vllm), or a compute dtype noisier than the thresholds allow "
    "(trainer.parity_thresholds)",
}
"""Check -> what usually causes its breach."""
_OWN_KEYS = ("actor/parity_gap_mean", "actor/parity_gap_max", "actor/parity_frac_beyond")


class ParityGuard:
    """The per-step parity checks of one run (module docstring)."""

    def __init__(self, mode: str, limits: Thresholds, backend: str = "") -> None:
        """`mode`: trainer.parity; `limits`: the log-prob check's; `backend`: rollout.name, for messages."""
        self.mode, self.limits, self.backend = mode, limits, backend
        self._warned_unchecked = False

    @classmethod
    def from_config(cls, cfg: Any) -> ParityGuard:
        """The guard of a resolved RunConfig: trainer.parity, its thresholds for the rollout backend and dtypes."""
        prec = precision(cfg.rollout.dtype, cfg.actor.engine.param_dtype)
        limits = cfg.trainer.parity_thresholds.resolve(cfg.rollout.name, prec)
        return cls(cfg.trainer.parity, limits, cfg.rollout.name)

    @property
    def ratio(self) -> float | None:
        """The ratio the update's own forward measures beyond (None when the guard is off)."""
        return None if self.mode == "off" else self.limits.ratio

    def before_update(self, batch: DataProto, step: int) -> dict[str, float]:
        """Run the weight, token and (where old log-probs exist) log-prob checks; their parity/* metrics."""
        if self.mode == "off":
            return {}
        findings = list(batch.meta_info.get(K.META_PARITY) or [])
        metrics = {"parity/weight_findings": float(len(findings))}
        if findings:
            self._breach("weights", step, "; ".join(findings[:5]) + (" ..." if len(findings) > 5 else ""))
        metrics.update(self._tokens(batch, step))
        b = batch.batch
        if K.ROLLOUT_LOG_PROBS not in b.keys():
            return {**metrics, **self._unchecked(step)}
        if K.OLD_LOG_PROBS not in b.keys():  # the update's own forward measures them: after_update sets it to 1
            return {**metrics, "parity/logprob_checked": 0.0}
        gaps = logprob_gaps(b[K.OLD_LOG_PROBS], b[K.ROLLOUT_LOG_PROBS], b[K.RESPONSE_MASK], self.limits.ratio)
        return {**metrics, **self._logprobs(gaps, step, in_update=False)}

    def after_update(self, outputs: list[DataProto], step: int) -> dict[str, float]:
        """The log-prob check from the update's own forward, when it measured one (else {}); its actor/parity_*
        metrics are taken out of `outputs` and reported as parity/* instead."""
        values: dict[str, list[float]] = {}
        for out in outputs:
            metrics = out.meta_info.get(K.META_METRICS, {})
            for key in _OWN_KEYS:
                if key in metrics:
                    value = metrics.pop(key)
                    values.setdefault(key, []).extend(value if isinstance(value, list) else [value])
        if self.mode == "off" or not values:
            return {}
        mean, top, beyond = (values.get(key, [0.0]) for key in _OWN_KEYS)
        gaps = LogprobGaps(sum(mean) / len(mean), max(top), sum(beyond) / len(beyond), -1)
        return self._logprobs(gaps, step, in_update=True)

    def _tokens(self, batch: DataProto, step: int) -> dict[str, float]:
        b = batch.batch
        if K.SAMPLED_IDS_HASH not in b.keys():
            return {"parity/token_checked_rows": 0.0, "parity/token_mismatch_rows": 0.0}
        mask = b[K.RESPONSE_MASK]
        trained = b[K.INPUT_IDS][:, -mask.shape[1] :]  # what the update's forward reads (= responses, if consistent)
        rows = mismatched_rows(b[K.SAMPLED_IDS_HASH], trained, mask)
        if rows:
            path = f"{_path(batch)}, rollout.name={self.backend}" if self.backend else _path(batch)
            shown = ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")
            detail = f"{len(rows)} of {len(batch)} rows ({path}) train ids that are not the sampled ones: rows {shown}"
            self._breach("tokens", step, detail)
        return {"parity/token_checked_rows": float(len(batch)), "parity/token_mismatch_rows": float(len(rows))}

    def _logprobs(self, gaps: LogprobGaps, step: int, in_update: bool) -> dict[str, float]:
        lim = self.limits
        over = [
            f"{name} {value:.4g} > {limit:g}"
            for name, value, limit in (
                ("gap_mean", gaps.gap_mean, lim.gap_mean),
                ("gap_max", gaps.gap_max, lim.gap_max),
                ("frac_beyond", gaps.frac_beyond, lim.frac_beyond),
            )
            if not value <= limit  # NaN breaches too
        ]
        if over:
            where = "the update's own forward" if in_update else "old_log_probs"
            detail = (
                f"trainer ({where}) vs rollout log-probs per token: {', '.join(over)} "
                f"(frac_beyond: |p_trainer / p_rollout - 1| > {lim.ratio:g}; trainer.parity_thresholds)"
            )
            self._breach("logprobs", step, detail)
        return {
            "parity/logprob_checked": 1.0,
            "parity/logprob_in_update": float(in_update),
            "parity/logprob_gap_mean": gaps.gap_mean,
            "parity/logprob_gap_max": gaps.gap_max,
            "parity/logprob_frac_beyond": gaps.frac_beyond,
        }

    def _unchecked(self, step: int) -> dict[str, float]:
        if not self._warned_unchecked:
            log.warning(
                "parity: step %d has no rollout_log_probs, so the log-prob check is skipped "
                "(parity/logprob_checked = 0); set rollout.calculate_log_probs=true to run it",
                step,
            )
            self._warned_unchecked = True
        return {"parity/logprob_checked": 0.0}

    def _breach(self, check: str, step: int, detail: str) -> None:
        message = f"parity check '{check}' failed at step {step}: {detail}. Usual cause: {CAUSES[check]}."
        if self.mode == "error":
            raise ParityError(message + " (trainer.parity=warn logs this and goes on; =off skips the checks)")
        log.warning("%s", message)


def _path(batch: DataProto) -> str:
    """Which generation path made the rows (for the token check's message)."""
    columns = batch.non_tensor_batch
    if K.HARNESS_STATUS in columns:
        return "agent harness: the endpoint's recorded completions"
    if K.NUM_TURNS in columns:
        return "multi-turn agent loop: each turn's sampled ids"
    return "single-turn rollout"
