"""Attention for the shared-prompt row that computes only the (query, key) pairs its mask allows.

The shared-prompt row (engine/prefix.py) lays out [prompt A][A1][A2]...[prompt B][B1]...; its mask lets
a prompt token see its prompt causally and a response token see its prompt and, causally, itself. A
dense masked product over the row computes N^2 pairs of which few are visible: at 32 completions of
32 tokens on 8 prompts of 64 (N = 1536) the dense product is 2.4M pairs, the visible ones ~0.1M, and
the two calls below compute 0.13M.
Here each prompt runs as one causal block, and each response as its queries against [its prompt ;
itself] (prompts and responses padded to the longest, the padding masked out or discarded): two
batched SDPA calls per layer whatever the number of groups, on gathered copies of q/k/v.

The engine switches its model to this implementation where it shares prompts; without a layout in the
forward's kwargs (plain rows, generation) the call is transformers' SDPA unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION_NAME = "hybridflow_prefix"
"""The attention implementation (transformers AttentionInterface) of a model that shares prompts."""
LAYOUT_KWARG = "hybridflow_prefix_layout"
"""The forward kwarg that carries a `PrefixLayout` down to every attention call."""


@dataclass
class PrefixLayout:
    """Index tensors into the packed row of G prompt groups and T responses."""

    prompt: torch.Tensor
    """[G, Pmax]: the packed columns of each prompt, its last column repeated past its end."""
    resp_q: torch.Tensor
    """[T, Rmax]: the packed columns of each response, its last column repeated past its end."""
    resp_kv: torch.Tensor
    """[T, Pmax + Rmax]: the keys each response sees, its prompt's columns then its own."""
    resp_mask: torch.Tensor
    """[T, 1, Rmax, Pmax + Rmax] bool: its prompt's real tokens, and its own tokens up to the query."""
    order: torch.Tensor
    """[N]: for each packed column, its row in the prompt outputs followed by the response outputs
    (both flattened), which puts the outputs back in the packed order."""

    def to(self, device: torch.device) -> PrefixLayout:
        return PrefixLayout(*(t.to(device) for t in vars(self).values()))


def build_layout(prompts: list[tuple[int, int]], responses: list[tuple[int, int, int]]) -> PrefixLayout:
    """The layout from the prompt spans (start, length) and the response spans (start, length, prompt group)."""
    p_max = max(n for _, n in prompts)
    r_max = max((n for _, n, _ in responses), default=1)
    steps_p, steps_r = torch.arange(p_max), torch.arange(r_max)
    p_start = torch.tensor([s for s, _ in prompts])
    p_len = torch.tensor([n for _, n in prompts])
    prompt = p_start[:, None] + torch.minimum(steps_p[None], p_len[:, None] - 1)
    r_start = torch.tensor([s for s, _, _ in responses], dtype=torch.long)
    r_len = torch.tensor([n for _, n, _ in responses], dtype=torch.long)
    group = torch.tensor([g for _, _, g in responses], dtype=torch.long)
    resp_q = r_start[:, None] + torch.minimum(steps_r[None], (r_len[:, None] - 1).clamp(min=0))
    resp_kv = torch.cat([prompt[group], resp_q], dim=1)
    sees_prompt = (steps_p[None] < p_len[group][:, None])[:, None, :].expand(-1, r_max, -1)
    sees_own = (steps_r[None, None, :] <= steps_r[None, :, None]) & (steps_r[None, None, :] < r_len[:, None, None])
    resp_mask = torch.cat([sees_prompt, sees_own], dim=2)[:, None]
    n = int(p_len.sum() + r_len.sum())
    order = torch.empty(n, dtype=torch.long)
    p_real = steps_p[None] < p_len[:, None]
    order[prompt[p_real]] = torch.arange(prompt.numel()).view_as(prompt)[p_real]
    r_real = steps_r[None] < r_len[:, None]
    order[resp_q[r_real]] = prompt.numel() + torch.arange(resp_q.numel()).view_as(resp_q)[r_real]
    return PrefixLayout(prompt, resp_q, resp_kv, resp_mask, order)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[1, heads, N, d] -> [B, heads, S, d]: the columns `index` [B, S] of the packed row."""
    return x[0][:, index.flatten()].unflatten(1, tuple(index.shape)).transpose(0, 1)


def prefix_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q/k/v [1, heads, N, d] -> output [1, N, heads, d]."""
    layout: PrefixLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    opts = {"dropout_p": dropout, "scale": scaling, "enable_gqa": gqa}
    kv = lambda index: (_take(key, index), _take(value, index))  # noqa: E731
    prompt = F.scaled_dot_product_attention(_take(query, layout.prompt), *kv(layout.prompt), is_causal=True, **opts)
    resp = F.scaled_dot_product_attention(
        _take(query, layout.resp_q), *kv(layout.resp_kv), attn_mask=layout.resp_mask, **opts
    )
    flat = torch.cat([prompt.transpose(1, 2).flatten(0, 1), resp.transpose(1, 2).flatten(0, 1)])
    return flat[layout.order].unsqueeze(0), None


def use_prefix_attention(model: nn.Module) -> bool:
    """Switch an SDPA `model` (a transformers PreTrainedModel) to `prefix_attention`; False where it runs
    another implementation (eager, flash-attention), which keeps the dense masked product."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(ATTENTION_NAME)
    return True


AttentionInterface.register(ATTENTION_NAME, prefix_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
