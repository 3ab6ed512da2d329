"""Turn generated tokens into the rollout output layout of hybridflow/protocol/keys.py.

Every backend ends here, so their outputs are interchangeable: B*n rows (the n
samples of a prompt adjacent), responses right-padded to exactly
`response_length`, masks and positions continuing from the left-padded prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from hybridflow.protocol import DataProto
from hybridflow.protocol.keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    SAMPLED_IDS_HASH,
)


def response_mask_from_tokens(responses: Tensor, eos_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """int64 [B, R] mask: 1 up to and including the first EOS of each row (all of `valid` if none)."""
    valid = torch.ones_like(responses, dtype=torch.bool) if valid is None else valid.bool()
    is_eos = torch.isin(responses, eos_ids) & valid
    after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    return (valid & ~after_eos).long()


def pad_responses(responses: Tensor, width: int, pad_id: int) -> Tensor:
    """Right-pad (or keep) [B, r] token ids to [B, width]; r must be <= width."""
    if responses.shape[1] > width:
        raise ValueError(
            f"backend returned {responses.shape[1]} response tokens, more than rollout.response_length={width}"
        )
    return torch.nn.functional.pad(responses, (0, width - responses.shape[1]), value=pad_id)


def build_output(
    prompts: DataProto,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    prompt_pos: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    n: int,
    log_probs: Tensor | None,
    sampled_hash: Tensor | None = None,
) -> DataProto:
    """Assemble the output DataProto (keys: prompts, responses, response_mask, input_ids,
    attention_mask, position_ids, optional rollout_log_probs and sampled_ids_hash); non-tensor rows
    and the prompt tensors are repeated n times so sample rows line up with their prompt.

    `responses`, `response_mask`, `log_probs`, `sampled_hash` already have B*n rows; tokens outside
    the mask must already be the pad id. `sampled_hash`: the backend's hash of the ids it drew
    (hybridflow/protocol/token_hash.py), taken where they were drawn; None leaves the key out.
    """
    ids = prompt_ids.repeat_interleave(n, dim=0)
    mask = prompt_mask.repeat_interleave(n, dim=0)
    pos = prompt_pos.repeat_interleave(n, dim=0)
    steps = torch.arange(1, responses.shape[1] + 1, dtype=pos.dtype)
    tensors = {
        PROMPTS: ids,
        RESPONSES: responses,
        RESPONSE_MASK: response_mask.long(),
        INPUT_IDS: torch.cat([ids, responses], dim=1),
        ATTENTION_MASK: torch.cat([mask.long(), response_mask.long()], dim=1),
        POSITION_IDS: torch.cat([pos, pos[:, -1:] + steps], dim=1),
    }
    if log_probs is not None:
        tensors[ROLLOUT_LOG_PROBS] = (log_probs * response_mask).float()
    if sampled_hash is not None:
        tensors[SAMPLED_IDS_HASH] = sampled_hash.long()
    non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
    meta: dict[str, Any] = dict(prompts.meta_info)
    return DataProto.from_dict(tensors, non_tensors, meta)
