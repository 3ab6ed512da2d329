"""Batch plumbing shared by engines: micro-batching, padding removal, response alignment.

Padding removal here is column trimming: a micro-batch keeps only the columns in
which at least one row has a real token (prompts are left-padded and responses
right-padded, so padding shared by all rows sits at both ends). Attention masks
and position ids are kept, so every attention backend (SDPA, eager) stays exact.

Packing (`pack`, `EngineConfig.packing`) goes further: the real tokens of all rows
are concatenated into ONE row with position ids restarting at 0 per example and no
attention mask; transformers (masking_utils.find_packed_sequence_indices, sdpa and
eager) then builds a block-diagonal causal mask from the position ids, so no token
attends across examples and the linear layers see no padding. On CPU the attention
itself is still a dense [N, N] masked product (no varlen kernel there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridflow.protocol import keys

if TYPE_CHECKING:
    from hybridflow.engine.prefix_attention import PrefixLayout

MODEL_INPUT_KEYS = (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES)


def select_inputs(data: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The model-input tensors of a batch (dict or TensorDict) on `device`.

    position_ids are derived from attention_mask when the batch has none.
    """
    missing = [k for k in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.RESPONSES) if k not in data.keys()]
    if missing:
        raise KeyError(f"batch lacks {missing}; an engine needs {list(MODEL_INPUT_KEYS)}")
    out = {k: data[k].to(device) for k in MODEL_INPUT_KEYS if k in data.keys()}
    if keys.POSITION_IDS not in out:
        out[keys.POSITION_IDS] = position_ids_from_mask(out[keys.ATTENTION_MASK])
    return out


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """cumsum(attention_mask) - 1 clipped at 0, as in hybridflow/protocol/keys.py."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class TokenBudget:
    """Micro-batches sized by tokens, not rows (verl's use_dynamic_bsz / *_max_token_len_per_gpu)."""

    max_tokens: int
    """Real (attention-mask) tokens per micro-batch; a longer row gets a micro-batch of its own."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"a token budget must be >= 1 token, got {self.max_tokens}")


MicroBatchSize = int | TokenBudget
"""Rows per micro-batch, or a token budget per micro-batch."""


def split_micro_batches(data: Mapping[str, torch.Tensor], size: MicroBatchSize) -> list[dict[str, torch.Tensor]]:
    """Split every [B, ...] tensor of `data` into consecutive micro-batches of `size` rows, or by a
    `TokenBudget` (`token_bounds`: as many micro-batches on every rank of the default group)."""
    rows = data[keys.INPUT_IDS].shape[0]
    if isinstance(size, TokenBudget):
        bounds = token_bounds(data[keys.ATTENTION_MASK].sum(-1).tolist(), size.max_tokens)
    elif size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {size}")
    else:
        bounds = list(range(0, rows, size)) + [rows]
    return [{k: data[k][a:b] for k in data.keys()} for a, b in zip(bounds, bounds[1:])]


def token_bounds(tokens: list[int], max_tokens: int) -> list[int]:
    """Cut points [0, ..., len(tokens)] of consecutive rows into micro-batches of at most `max_tokens`
    tokens each (a longer row alone), filled greedily in order.

    FSDP ranks must run the same number of forwards: where another rank of the default process
    group needs more micro-batches, the heaviest ones here are halved (by tokens) until the counts agree.
    """
    bounds, filled = [0], 0
    for i, t in enumerate(tokens):
        if filled and filled + t > max_tokens:
            bounds.append(i)
            filled = 0
        filled += t
    bounds.append(len(tokens))
    need = min(_max_over_ranks(len(bounds) - 1), len(tokens))
    while len(bounds) - 1 < need:
        load = lambda j: sum(tokens[bounds[j] : bounds[j + 1]]) if bounds[j + 1] - bounds[j] > 1 else -1  # noqa: E731
        j = max(range(len(bounds) - 1), key=load)
        a, b, half, run = bounds[j], bounds[j + 1], load(j) / 2, 0
        cut = next((k for k in range(a + 1, b) if (run := run + tokens[k - 1]) >= half), b - 1)
        bounds.insert(j + 1, cut)
    return bounds


def _max_over_ranks(n: int) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


@dataclass(frozen=True)
class ResponseWindow:
    """Where a (trimmed) micro-batch's response predictions sit.

    Columns [start, end) of the padded [b, T] batch are fed to the model; the
    positions P-1 .. end-2 predict the response columns 0 .. n_valid-1.
    """

    start: int
    """First kept column of the padded batch."""
    end: int
    """One past the last kept column."""
    prompt_len: int
    """P = T - R: the column where responses start in the padded batch."""
    response_len: int
    """R of the padded batch (outputs are padded back to it)."""

    @property
    def n_valid(self) -> int:
        """Response columns that hold a real token in at least one row."""
        return max(self.end - self.prompt_len, 0)

    @property
    def logits_to_keep(self) -> int:
        """Trailing positions whose logits are needed (>= 1; one more than predicted)."""
        return self.n_valid + 1


def response_window(micro: Mapping[str, torch.Tensor], remove_padding: bool) -> ResponseWindow:
    """Column window of `micro` to run the model on (the whole batch unless `remove_padding`)."""
    mask = micro[keys.ATTENTION_MASK]
    total, resp = mask.shape[1], micro[keys.RESPONSES].shape[1]
    prompt_len = total - resp
    if not remove_padding:
        return ResponseWindow(0, total, prompt_len, resp)
    cols = mask.bool().any(dim=0).nonzero().flatten()
    if cols.numel() == 0:
        raise ValueError("micro-batch has no real tokens (attention_mask is all zero)")
    # The last prompt column always holds a token (keys.py), but keep it even if not.
    start = min(int(cols[0]), prompt_len - 1) if prompt_len > 0 else 0
    end = max(int(cols[-1]) + 1, prompt_len)
    return ResponseWindow(start, end, prompt_len, resp)


def trim(micro: Mapping[str, torch.Tensor], win: ResponseWindow) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / position_ids restricted to the window's columns."""
    cols = slice(win.start, win.end)
    return {
        "input_ids": micro[keys.INPUT_IDS][:, cols],
        "attention_mask": micro[keys.ATTENTION_MASK][:, cols],
        "position_ids": micro[keys.POSITION_IDS][:, cols],
    }


def pad_to_response(values: torch.Tensor, win: ResponseWindow, response_mask: torch.Tensor) -> torch.Tensor:
    """[b, n_valid] per-token values -> [b, R] fp32, zero past n_valid and on masked entries."""
    out = values.new_zeros(values.shape[0], win.response_len, dtype=torch.float32)
    out[:, : win.n_valid] = values.float()
    return torch.where(response_mask.bool(), out, torch.zeros_like(out))


def response_mask_of(micro: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[b, R] mask of real response tokens (the response part of attention_mask)."""
    resp = micro[keys.RESPONSES].shape[1]
    return micro[keys.ATTENTION_MASK][:, -resp:]


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch's real tokens as one row, and where its response predictions go back."""

    input_ids: torch.Tensor
    """[1, N]: every row's real tokens, back to back, in row order."""
    position_ids: torch.Tensor
    """[1, N]: positions restarting at 0 for each example (what marks the example boundaries)."""
    predictors: torch.Tensor
    """[n]: columns of the packed row whose next-token prediction is a response token."""
    labels: torch.Tensor
    """[n]: the response tokens those columns predict."""
    response_mask: torch.Tensor
    """[b, R] bool: where the n predictions sit in the padded layout (row-major order)."""
    attention_mask: torch.Tensor | None = None
    """None: examples are told apart by their restarting position ids; else an explicit
    [1, 1, N, N] bool mask (shared-prompt packing, hybridflow/engine/prefix.py)."""
    prefix: PrefixLayout | None = None
    """The shared-prompt row's groups as index tensors (engine/prefix_attention.py `PrefixLayout`), for an
    attention that computes only the pairs the mask allows; None for other rows."""


def pack(micro: Mapping[str, torch.Tensor]) -> PackedBatch:
    """Concatenate the real tokens of every row of `micro` (padded layout) into one row.

    Each row's position ids must start at 0 at its first real token (keys.py: cumsum of the mask).
    """
    mask = micro[keys.ATTENTION_MASK].bool()
    packed_col = mask.flatten().long().cumsum(0).view_as(mask) - 1  # column of each real token in the row
    rmask = response_mask_of(micro).bool()
    targets = packed_col[:, -rmask.shape[1] :][rmask]
    if targets.numel() and int(targets.min()) < 1:
        raise ValueError("a packed row needs at least one prompt token before each response")
    return PackedBatch(
        input_ids=micro[keys.INPUT_IDS][mask].unsqueeze(0),
        position_ids=micro[keys.POSITION_IDS][mask].unsqueeze(0),
        predictors=targets - 1,
        labels=micro[keys.RESPONSES][rmask],
        response_mask=rmask,
    )


def unpack_to_response(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """[n] per-prediction values of a packed row -> [b, R] fp32, zero off the response mask."""
    out = values.new_zeros(packed.response_mask.shape, dtype=torch.float32)
    return out.masked_scatter(packed.response_mask, values.float())
