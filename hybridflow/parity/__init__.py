"""The parity guard: no silent mismatch between what the trainer holds and what the rollout used.

Three checks, each every step (issue 31):
- weights (fingerprint.py): after every sync into a rollout, the fingerprints of what the sender meant to send
  and of what the rollout now holds; a difference is a finding naming the backend, the sync path, the step and
  the first differing tensors;
- log-probs: the rollout's log-probs of the sampled tokens against the trainer's, per token;
- tokens: the ids the trainer trains against the ids the sampler drew (`keys.SAMPLED_IDS_HASH`).
Workers report findings in meta_info[`keys.META_PARITY`]; the controller's guard raises `ParityError`
(trainer.parity=error) or warns (warn), and logs `parity/*` metrics.
"""

from __future__ import annotations


class ParityError(RuntimeError):
    """The trainer and the rollout disagree (weights, log-probs or tokens); the run stops, it is never retried."""
