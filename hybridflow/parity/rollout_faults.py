"""The log-prob / token parity faults (parity/faults.py), applied to a generate worker's output; tests only."""

from __future__ import annotations

from hybridflow.parity.faults import parity_fault
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K

SKEW_NATS = 0.5
"""What `logprob_skew` subtracts from each rollout log-prob."""


def apply_rollout_faults(out: DataProto, step: int | None) -> None:
    """Break `out` in place as HYBRIDFLOW_PARITY_FAULT asks for training step `step` (None: never)."""
    if parity_fault("token_edit", step):
        _edit_first_trained_token(out)
    if parity_fault("logprob_skew", step) and K.ROLLOUT_LOG_PROBS in out.batch.keys():
        mask = out.batch[K.RESPONSE_MASK]
        out.batch[K.ROLLOUT_LOG_PROBS] = out.batch[K.ROLLOUT_LOG_PROBS] - SKEW_NATS * mask


def _edit_first_trained_token(out: DataProto) -> None:
    """Row 0's first trained token becomes another id, in `responses` and `input_ids` alike (a consistent
    batch, as a re-tokenization would leave it)."""
    trained = out.batch[K.RESPONSE_MASK][0].nonzero()
    if len(trained) == 0:
        return
    col = int(trained[0])
    responses, input_ids = out.batch[K.RESPONSES].clone(), out.batch[K.INPUT_IDS].clone()  # not inference tensors
    old = int(responses[0, col])
    responses[0, col] = input_ids[0, out.batch[K.PROMPTS].shape[1] + col] = old - 1 if old > 0 else old + 1
    out.batch[K.RESPONSES], out.batch[K.INPUT_IDS] = responses, input_ids
