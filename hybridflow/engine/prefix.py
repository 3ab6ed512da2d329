"""Shared-prompt packing: the n samples of a prompt run against ONE copy of the prompt.

A GRPO batch holds n responses per prompt, and on the arithmetic task the prompt (chat
template included) is ~45 tokens against ~11-24 response tokens: the padded or plainly
packed layouts push every prompt n times through every layer, forward and backward.
Here a micro-batch becomes one row: each distinct prompt once, then the responses of
every row that has it, and a block mask lets each response see its prompt and, causally,
itself only. Each response keeps its own position ids (continuing after the prompt), so
it sees exactly the context it had alone; the prompt's activations are computed once and
shared, so in backward their gradient is the sum over the responses, as with separate rows.

The row carries a dense [N, N] boolean mask (transformers takes a 4-D mask as given; the
Ulysses and SDPA paths use it) and the index layout of its groups, with which
engine/prefix_attention.py computes only the visible pairs: each prompt causally, each response
against its prompt and itself. `sharing_pays` decides per micro-batch from the model's shape
(a FLOP estimate) whether the row costs less than the trimmed padded rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridflow.engine.batch import PackedBatch, response_mask_of
from hybridflow.engine.prefix_attention import build_layout
from hybridflow.protocol import keys


def _group_rows(micro: Mapping[str, torch.Tensor], prompt_len: int) -> list[list[int]]:
    """Rows of the micro-batch grouped by identical prompt (its real tokens), in order of first appearance."""
    ids, mask = micro[keys.INPUT_IDS][:, :prompt_len], micro[keys.ATTENTION_MASK][:, :prompt_len].bool()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(ids.shape[0]):
        groups.setdefault(tuple(ids[row][mask[row]].tolist()), []).append(row)
    return list(groups.values())


def _shared_row_cost(micro: Mapping[str, torch.Tensor], groups: list[list[int]], dense: bool) -> tuple[int, int]:
    """(tokens, attention pairs) of the shared-prompt row of `groups`: N^2 pairs under the dense mask, else what
    prefix_attention computes (each prompt group padded to the longest prompt, each response to the longest
    response)."""
    mask = micro[keys.ATTENTION_MASK].bool()
    prompt_len = mask.shape[1] - micro[keys.RESPONSES].shape[1]
    prompts = [int(mask[g[0], :prompt_len].sum()) for g in groups]
    responses = mask[:, prompt_len:].sum(dim=1)
    n = sum(prompts) + int(responses.sum())
    if dense:
        return n, n * n
    p_max, r_max, t = max(prompts), int(responses.max()), int((responses > 0).sum())
    return n, len(groups) * p_max * p_max + t * r_max * (p_max + r_max)


def sharing_pays(micro: Mapping[str, torch.Tensor], model_config, dense_attention: bool = False) -> bool:
    """Whether some rows share a prompt and the shared-prompt row costs fewer FLOPs than the trimmed padded rows.

    Per token the linear layers cost 2 * L * (2h^2 + 2h*kv + 3h*I) (attention projections with
    grouped KV, gated MLP); per (query, key) pair attention costs 4 * L * h. The trimmed layout
    runs rows x width tokens and rows x width^2 pairs; the shared row N tokens and the pairs its
    attention computes (`dense_attention`: all N^2 of them). Rows that all have different prompts
    keep the trimmed layout: packing them is `EngineConfig.packing`'s choice, not this one's.
    """
    mask = micro[keys.ATTENTION_MASK].bool()
    groups = _group_rows(micro, mask.shape[1] - micro[keys.RESPONSES].shape[1])
    if all(len(g) == 1 for g in groups):
        return False
    c = model_config
    h, layers, inter = c.hidden_size, c.num_hidden_layers, c.intermediate_size
    kv = c.num_key_value_heads * (getattr(c, "head_dim", None) or h // c.num_attention_heads)
    per_token = 2 * layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    per_pair = 4 * layers * h
    rows, cols = mask.shape[0], mask.any(dim=0).nonzero().flatten()
    width = int(cols[-1] - cols[0] + 1) if cols.numel() else 0
    n, pairs = _shared_row_cost(micro, groups, dense_attention)
    return n * per_token + pairs * per_pair < rows * width * per_token + rows * width * width * per_pair


def pack_shared_prompts(micro: Mapping[str, torch.Tensor]) -> PackedBatch:
    """One packed row per micro-batch in which rows with the same prompt share one copy of it.

    Layout: [prompt A][response A1][response A2]...[prompt B][response B1]...; `attention_mask`
    is [1, 1, N, N] bool (True: may attend). Outputs map back with `batch.unpack_to_response`.
    """
    mask = micro[keys.ATTENTION_MASK].bool()
    rmask = response_mask_of(micro).bool()
    prompt_len = mask.shape[1] - rmask.shape[1]
    rows, cols, segment, owner = [], [], [], []
    prompt_spans: list[tuple[int, int]] = []
    response_spans: list[tuple[int, int, int]] = []
    response_cols: dict[int, torch.Tensor] = {}  # row -> packed columns of its response tokens
    last_prompt_col: dict[int, int] = {}
    n = 0
    for g, group in enumerate(_group_rows(micro, prompt_len)):
        first = group[0]
        p_cols = mask[first, :prompt_len].nonzero().flatten()
        if p_cols.numel() == 0:
            raise ValueError("shared-prompt packing needs at least one prompt token in every row")
        rows += [first] * len(p_cols)
        cols += p_cols.tolist()
        segment += [g] * len(p_cols)
        owner += [-1] * len(p_cols)
        prompt_spans.append((n, len(p_cols)))
        n += len(p_cols)
        p_last = n - 1
        for row in group:
            r_cols = rmask[row].nonzero().flatten() + prompt_len
            rows += [row] * len(r_cols)
            cols += r_cols.tolist()
            segment += [g] * len(r_cols)
            owner += [row] * len(r_cols)
            response_cols[row] = torch.arange(n, n + len(r_cols))
            if len(r_cols):
                response_spans.append((n, len(r_cols), g))
            last_prompt_col[row] = p_last
            n += len(r_cols)
    device = mask.device
    rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
    predictors = torch.cat(
        [
            torch.cat([torch.tensor([last_prompt_col[row]]), response_cols[row][:-1]])
            for row in range(mask.shape[0])
            if row in response_cols and len(response_cols[row])
        ]
        or [torch.zeros(0, dtype=torch.long)]
    )
    return PackedBatch(
        input_ids=micro[keys.INPUT_IDS][rows_t, cols_t].unsqueeze(0),
        position_ids=micro[keys.POSITION_IDS][rows_t, cols_t].unsqueeze(0),
        predictors=predictors.to(device),
        labels=micro[keys.RESPONSES][rmask],
        response_mask=rmask,
        attention_mask=_block_mask(torch.tensor(segment), torch.tensor(owner)).to(device),
        prefix=build_layout(prompt_spans, response_spans).to(device),
    )


def _block_mask(segment: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """[1, 1, N, N]: i attends j iff same prompt group, j <= i, and j is prompt or i's own response."""
    n = segment.numel()
    same_group = segment[:, None] == segment[None, :]
    visible = (owner[None, :] == -1) | (owner[None, :] == owner[:, None])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (same_group & visible & causal)[None, None]
