"""Ulysses sequence parallel: every micro-batch's tokens split over sp ranks (step 2 of engine/parallel/parallelize.py).

The world is laid out as dp x sp x tp, tp fastest (engine/parallel/dims.py):
the sp ranks of one dp group hold the same rows of the batch. Each micro-batch runs as ONE packed
row (hybridflow/engine/batch.py `pack`, or the shared-prompt row of engine/prefix.py), padded to a
multiple of sp, and each sp rank runs its contiguous 1/sp of those tokens through the embedding,
norms, projections, MLP and head. Around attention (DeepSpeed-Ulysses, arXiv 2309.14509) an
all-to-all turns [local tokens, all heads] into [all tokens, this rank's heads] for q, k and v (after
RoPE, which saw the sliced position ids), attention runs over the whole packed row block by block
(each example, or each prompt group of a shared-prompt row, found from the full position ids: no
token attends across blocks, so no [N, N] mask is built), and a second all-to-all turns the output
back. FSDP2 shards parameters over the dp x sp ranks (engine/parallel/parallelize.py), so checkpoints are the
plain FSDP layout and load at any sp.

Heads are split by whole kv groups, as evenly as they go: with 3 kv heads (SmolLM2: 9 q heads) and
sp = 2, sp rank 0 attends with 2 kv groups (6 q heads) and rank 1 with 1 group (3 q heads), through
all-to-alls with uneven split sizes. With more sp ranks than kv heads (e.g. tensor parallel 3 leaves
SmolLM2 one kv head per rank), each kv head is first repeated for its group's q heads and the q heads
are split as evenly as they go, each rank receiving the copies of k and v its q heads use (the
all-to-all moves up to `groups` x more k/v; the repeat's backward sums the copies' gradients). sp must
be at most the number of q heads a rank holds.

Outputs and gradients: each rank computes log-probs / entropy / values for the response tokens its
slice predicts, and a sum over the sp group (autograd-aware: its backward is the same sum) hands every
sp rank the whole micro-batch's outputs, so every sp rank computes the same loss. The backward sum
gives each rank sp x the gradient of its own tokens' share; FSDP2 then averages over dp x sp ranks,
which divides that sp back out: the gradient is the one process's, as with data parallel alone.

LoRA adapters need nothing here (peft wraps the projections; attention is untouched). With tensor
parallel, each rank's attention sees the 1/tp of the heads it holds, and the sp ranks split those (so sp
must be at most num_attention_heads / tp). Not here: sliding-window attention (refused at load). Attention is one SDPA call per block (causal
for an example, under its own mask for a shared-prompt group): a loop, not a varlen kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

import hybridflow.engine.batch as B
from hybridflow.engine.base import MicroBatch
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.prefix import pack_shared_prompts
from hybridflow.models.value import ValueModel

ATTENTION_NAME = "hybridflow_ulysses"
"""The attention implementation (transformers AttentionInterface) the engine sets on its model."""


def kv_head_splits(num_kv_heads: int, sp: int) -> list[int]:
    """Whole heads per sp rank (kv heads; q heads where k/v are repeated for them), as even as possible, the
    larger shares first: (3, 2) -> [2, 1]."""
    return [num_kv_heads // sp + (r < num_kv_heads % sp) for r in range(sp)]


def check_sp_layout(
    sp: int,
    world: int,
    num_heads: int,
    num_kv_heads: int,
    key: str = "engine.ulysses_sequence_parallel_size",
    tp: int = 1,
) -> None:
    """Refuse a layout Ulysses cannot run: sp must divide the ranks and be at most the number of q heads a
    tensor-parallel rank holds (num_attention_heads / `tp`: each rank attends with at least one; `key`: the
    config key named in the message)."""
    if sp < 1:
        raise ValueError(f"{key} must be >= 1, got {sp}")
    problems = []
    if world % sp:
        problems.append(f"must divide the number of ranks ({world})")
    if sp > num_heads // tp:
        per_rank = f" / tensor_parallel_size ({tp}) = {num_heads // tp}" if tp > 1 else ""
        problems.append(
            f"must be at most num_attention_heads ({num_heads}){per_rank}: each sp rank attends with at least one head"
        )
    if num_heads % num_kv_heads:
        problems.append(
            f"needs num_attention_heads ({num_heads}) to be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    if problems:
        raise ValueError(
            f"{key}={sp} "
            + "; ".join(problems)
            + f"; the model has {num_heads} attention heads and {num_kv_heads} kv heads"
        )


Block = tuple[int, int, "torch.Tensor | None"]
"""(start, end, mask) of a run of the packed row that attends only within itself: mask None is causal,
else a [end - start, end - start] bool mask (True: may attend)."""


@dataclass
class SPLayout:
    """One rank's place in its sp group, how the heads are split over the group, and the current row's blocks."""

    group: Any
    """The sp process group (the sp ranks of this rank's dp group)."""
    rank: int
    """This rank's place in the group."""
    size: int
    """Ranks in the group."""
    q_splits: list[int]
    """Query heads each sp rank attends with (whole kv groups' worth unless `expand_kv`)."""
    kv_splits: list[int]
    """Key/value heads each sp rank attends with."""
    expand_kv: bool = False
    """k and v repeated for their q heads before the all-to-all (more sp ranks than kv heads): kv_splits is
    q_splits."""
    blocks: list[Block] = field(default_factory=list)
    """Attention blocks of the packed row being run: set by the engine before each forward, and still
    valid in its backward (which recomputes attention under gradient checkpointing)."""


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with split sizes; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) whose backward is the same sum of the incoming gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SumOverGroup.apply(grad, ctx.group), None


def heads_to_sequence(x: torch.Tensor, splits: list[int], sp: SPLayout) -> torch.Tensor:
    """[b, heads, local tokens, d] on every rank -> [b, splits[rank] heads, all tokens, d]."""
    b, _, s, d = x.shape
    mine = splits[sp.rank]
    out = _AllToAll.apply(x.transpose(0, 1), splits, [mine] * sp.size, sp.group)  # [sp * mine, b, s, d]
    return out.view(sp.size, mine, b, s, d).permute(2, 1, 0, 3, 4).reshape(b, mine, sp.size * s, d)


def sequence_to_heads(x: torch.Tensor, splits: list[int], sp: SPLayout) -> torch.Tensor:
    """The inverse of `heads_to_sequence`: [b, splits[rank] heads, all tokens, d] -> [b, heads, local tokens, d]."""
    b, mine, n, d = x.shape
    s = n // sp.size
    chunks = x.view(b, mine, sp.size, s, d).permute(2, 1, 0, 3, 4).reshape(sp.size * mine, b, s, d)
    return _AllToAll.apply(chunks, [mine] * sp.size, splits, sp.group).transpose(0, 1)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q/k/v [b, heads, local tokens, d] -> output [b, local tokens, heads, d].

    The sp layout and the row's attention blocks hang on the attention module (`apply_ulysses` puts
    them there); transformers builds no mask for this attention implementation (`attention_mask` is None)."""
    sp: SPLayout = module.hybridflow_sp
    q = heads_to_sequence(query, sp.q_splits, sp)
    before, after = (module.num_key_value_groups, 1) if sp.expand_kv else (1, module.num_key_value_groups)
    k = repeat_kv(heads_to_sequence(repeat_kv(key, before), sp.kv_splits, sp), after)
    v = repeat_kv(heads_to_sequence(repeat_kv(value, before), sp.kv_splits, sp), after)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = torch.cat(
        [
            sdpa(
                q[:, :, a:b],
                k[:, :, a:b],
                v[:, :, a:b],
                attn_mask=mask,
                is_causal=mask is None,
                dropout_p=dropout,
                scale=scaling,
            )
            for a, b, mask in sp.blocks
        ],
        dim=2,
    )
    return sequence_to_heads(out, sp.q_splits, sp).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, ulysses_attention)


def padded_row(packed: B.PackedBatch, sp: int) -> tuple[torch.Tensor, torch.Tensor, list[Block]]:
    """(input_ids [1, M], position_ids [1, M], attention blocks) of the packed row padded to a multiple M of `sp`.

    A block starts at every position id 0: an example of a plain packed row, or a prompt group of a shared-prompt
    row (its responses continue the prompt's positions), which keeps its part of the row's mask. The padding
    tokens form a causal block of their own."""
    n = packed.input_ids.shape[1]
    pad = -n % sp
    ids = torch.cat([packed.input_ids, packed.input_ids.new_zeros(1, pad)], dim=1)
    pos = torch.cat([packed.position_ids, torch.arange(pad, device=ids.device).unsqueeze(0)], dim=1)
    starts = sorted({0, *(pos[0] == 0).nonzero().flatten().tolist()})
    bounds = list(zip(starts, starts[1:] + [n + pad]))
    if packed.attention_mask is None:
        return ids, pos, [(a, b, None) for a, b in bounds]
    mask = packed.attention_mask[0, 0]
    return ids, pos, [(a, b, mask[a:b, a:b] if a < n else None) for a, b in bounds]


def apply_ulysses(model: nn.Module, sp_mesh: DeviceMesh, tp: int = 1) -> SPLayout:
    """Switch `model`'s attention to Ulysses over `sp_mesh` (the sp ranks of this rank's dp group) and hang the
    shared `SPLayout` on every attention module. With tensor parallel (`tp` > 1, applied before) each rank
    holds 1/tp of the heads, and the sp ranks split those."""
    hf, sp = model.config, sp_mesh.size()
    check_sp_layout(sp, sp, hf.num_attention_heads, hf.num_key_value_heads, tp=tp)
    heads, kv_heads = hf.num_attention_heads // tp, hf.num_key_value_heads // tp
    if "sliding_attention" in (getattr(hf, "layer_types", None) or []):
        raise ValueError("engine.ulysses_sequence_parallel_size > 1: sliding-window attention is not supported")
    if sp > kv_heads:  # a kv group spans sp ranks: each gets the k/v copies of its q heads
        q = kv_head_splits(heads, sp)
        layout = SPLayout(sp_mesh.get_group(), sp_mesh.get_local_rank(), sp, q, q, expand_kv=True)
    else:
        kv = kv_head_splits(kv_heads, sp)
        groups = heads // kv_heads
        layout = SPLayout(sp_mesh.get_group(), sp_mesh.get_local_rank(), sp, [n * groups for n in kv], kv)
    (model.backbone if isinstance(model, ValueModel) else model).set_attn_implementation(ATTENTION_NAME)
    attention = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    if not attention:
        raise ValueError(f"sequence parallel: found no attention modules in {type(model).__name__}")
    for m in attention:
        m.hybridflow_sp = layout
    return layout


def sp_packed_row(inputs: MicroBatch, config: EngineConfig) -> B.PackedBatch:
    """The packed row a micro-batch runs as under sequence parallel: `packing` picks plain packing, else
    `share_prompts` the shared-prompt row (sharing never adds tokens, and attention runs block by block in both)."""
    share = config.share_prompts and not config.packing
    return pack_shared_prompts(inputs) if share else B.pack(inputs)


def forward_sp_packed(
    model: nn.Module, sp: SPLayout, packed: B.PackedBatch, value: bool, token_outputs: Callable
) -> dict[str, torch.Tensor]:
    """This rank's slice of the padded packed row through `model`; outputs summed over the sp group.
    `token_outputs(logits, labels, place)`: the engine's log-probs / entropy of `labels`, placed by `place`."""
    ids, pos, sp.blocks = padded_row(packed, sp.size)
    width = ids.shape[1] // sp.size
    start = sp.rank * width
    mine = (packed.predictors >= start) & (packed.predictors < start + width)
    local = packed.predictors[mine] - start
    row = {"input_ids": ids[:, start : start + width], "position_ids": pos[:, start : start + width]}

    def place(values: torch.Tensor, link: torch.Tensor) -> torch.Tensor:
        # + link (a zero on the model's graph): a rank whose slice predicts no response token still
        # runs the whole backward, whose all-to-alls its sp peers wait for.
        whole = values.new_zeros(mine.shape, dtype=torch.float32).masked_scatter(mine, values.float() + link)
        return B.unpack_to_response(_SumOverGroup.apply(whole, sp.group), packed)

    if value:
        values = model(**row, use_cache=False)
        return {"values": place(values[0, local], values[:, :0].sum())}
    logits = model(**row, logits_to_keep=local, use_cache=False).logits[0]
    link = logits[:0].sum()
    return token_outputs(logits, packed.labels[mine], lambda v: place(v, link))
