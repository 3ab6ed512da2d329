"""The native rollout's generation shard: which weights its tensor parallel splits, and this rank's part.

Megatron's split of a Llama/Qwen2 decoder layer over tp ranks: q/k/v and gate/up by output rows
(weight dim 0, and their biases), o and down by input columns (weight dim 1; their biases, if any, stay
whole and only tp rank 0 adds them). The embedding and the LM head are split by vocabulary rows
(when tp divides the vocabulary; else whole); norms stay whole on every rank. Heads are contiguous
blocks of rows, so even chunks of rows keep whole heads.

With rollout.tensor_model_parallel_size > 1 the native rollout replaces each split weight of its module
by its own copy of this rank's chunk (`shard_module_`), so after construction a rank holds only its
generation shard of the decoder layers; `load_weights` then takes either such shards or full tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ROW_SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
"""Projections split by output rows: weight and bias along dim 0."""
COL_SPLIT = ("self_attn.o_proj", "mlp.down_proj")
"""Projections split by input columns: weight along dim 1 (the bias stays whole)."""


def split_dims(model: nn.Module, tp: int) -> dict[str, int]:
    """Name (as in `model.state_dict()`) -> the dim tensor parallel over `tp` ranks splits it along, for
    every split weight; the embedding and LM head are split by vocabulary rows when `tp` divides it."""
    vocab_split = model.get_input_embeddings().num_embeddings % tp == 0
    vocab = ("model.embed_tokens", "lm_head") if vocab_split else ()
    dims: dict[str, int] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        module, _, leaf = name.rpartition(".")
        if module.endswith(ROW_SPLIT) or module in vocab:
            dims[name] = 0
        elif module.endswith(COL_SPLIT) and leaf == "weight":
            dims[name] = 1
    return dims


def chunk_of(t: Tensor, dim: int, rank: int, tp: int) -> Tensor:
    """`rank`'s even chunk of `t` along `dim` (a view); refuses sizes `tp` does not divide."""
    n = t.shape[dim]
    if n % tp:
        raise ValueError(
            f"tensor parallel over {tp} ranks needs dim {dim} of size {n} to divide evenly "
            f"(heads, kv heads and intermediate_size must be multiples of {tp})"
        )
    return t.narrow(dim, rank * (n // tp), n // tp)


def own_part(t: Tensor, dim: int, rank: int, tp: int, full: int) -> Tensor:
    """`t` if it already is this rank's chunk (dim `dim` is `full` / tp), else its chunk of the full `t`."""
    if tp > 1 and t.shape[dim] == full // tp:
        return t
    if t.shape[dim] != full:
        raise ValueError(
            f"expected dim {dim} of size {full} (whole) or {full // tp} (one of {tp} shards), "
            f"got shape {tuple(t.shape)}"
        )
    return chunk_of(t, dim, rank, tp)


def shard_module_(model: nn.Module, dims: dict[str, int], rank: int, tp: int) -> dict[str, int]:
    """Replace every weight named in `dims` by a compact copy of `rank`'s chunk (the full one is freed
    once nothing else holds it); returns each replaced weight's full size along its split dim."""
    full: dict[str, int] = {}
    parts: dict[int, nn.Parameter] = {}  # tied weights (embedding and LM head) stay one tensor
    with torch.no_grad():
        for name, dim in dims.items():
            path, _, leaf = name.rpartition(".")
            module = model.get_submodule(path)
            weight = getattr(module, leaf)
            full[name] = weight.shape[dim]
            if id(weight) not in parts:
                part = chunk_of(weight.data, dim, rank, tp).clone()
                parts[id(weight)] = nn.Parameter(part, requires_grad=weight.requires_grad)
            setattr(module, leaf, parts[id(weight)])
    return full
