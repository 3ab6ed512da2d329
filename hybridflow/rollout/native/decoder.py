"""Batched incremental decoders behind the native rollout.

A decoder holds one batch of sequences and their KV cache:
`prefill` runs the left-padded prompts, `step` appends one token per row, and
`select(rows)` keeps, reorders or repeats rows of the batch (dropping finished
sequences, or expanding each prompt to its n samples after one prefill).
Both return fp32 logits of the last position only.

- `StaticLlamaDecoder`: a lean forward for Llama-style decoders (Llama, Qwen2:
  RMSNorm, rotary attention with grouped KV heads, SiLU-gated MLP) written
  against the HF module's own weights, with a preallocated cache and fused
  q/k/v and gate/up projections. A decode step runs ~25 tensor ops per layer,
  where the HF module stack adds per-call bookkeeping (mask building, cache
  objects, output dataclasses) that dominates small models on CPU; where
  rollout/native/fused_step.py covers the model (fp32 on the panel kernel, one
  rank), the whole decode step is one C call instead.
- `HFDecoder`: any HF causal LM through its own forward and a DynamicCache
  (the fallback for architectures the static path does not cover).

With a tensor-parallel group (rollout.tensor_model_parallel_size) the static decoder
runs its share of the heads and of the MLP's columns (Megatron's split: q/k/v and
gate/up by output rows, o and down by input columns, one all-reduce after each) and
keeps its share of the KV cache; the embedding and LM head are split by vocabulary rows (when
tp divides the vocabulary: each rank embeds its own ids, one all-reduce; logits all-gathered),
norms stay whole. The module may hold the full weights or (the native rollout's case) only this
rank's shard of them. Every rank of the group must get the same prompts and sample the same
tokens (same seed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache

from hybridflow.rollout.native.fused_step import FusedStep, fused_path
from hybridflow.rollout.native.kernels import EAGER, DecoderKernels
from hybridflow.rollout.native.linear import Linear, compute_dtype
from hybridflow.rollout.native.sharding import own_part

_FAST_MODEL_TYPES = ("llama", "qwen2")
# Decode steps attend over the whole preallocated cache (unwritten slots masked) when it is at most this
# long: matmul copies a strided slice of the cache, which costs more than the masked columns (SmolLM2,
# batch 64: 0.21-1.06 ms per layer at 128-512 slots, vs 0.40-1.37 ms on average for SDPA on the slice).
FULL_CACHE_DECODE_MAX_LEN = 512
FUSED_DECODE = True
"""Whether decoders run decode steps through decode_step.c where it covers them (`fused=None`)."""


def supports_static_path(model: nn.Module) -> bool:
    """True when `model` has the Llama-style layout `StaticLlamaDecoder` implements."""
    cfg = model.config
    if cfg.model_type not in _FAST_MODEL_TYPES or cfg.hidden_act != "silu":
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    attn = model.model.layers[0].self_attn
    return not hasattr(attn, "q_norm") and hasattr(attn, "q_proj")


@dataclass
class _LayerWeights:
    ln1: Tensor
    qkv: Linear
    o: Linear
    ln2: Tensor
    gate_up: Linear
    down: Linear


def _cat_bias(*mods: nn.Linear, rank: int = 0, tp: int = 1) -> Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return torch.cat(
        [
            own_part(m.bias, 0, rank, tp, m.out_features)
            if m.bias is not None
            else m.weight.new_zeros(m.out_features // tp)
            for m in mods
        ]
    )


def _layer_weights(
    layer: nn.Module,
    dtype: torch.dtype,
    rank: int = 0,
    tp: int = 1,
    weight_dtype: torch.dtype | None = None,
    path: str | None = None,
) -> _LayerWeights:
    """The layer's fused weights, norms in the decoder's compute `dtype`; with tp > 1 this rank's share (heads are
    contiguous blocks of rows, so chunking rows by tp keeps whole heads), taken from the full weights or, when the
    native rollout holds only its shard (rollout/native/sharding.py), used as they are. The o/down bias is added once, by
    tp rank 0. `path`: the products' layout (rollout/native/linear.py), None for `Linear`'s timed choice."""
    a, m = layer.self_attn, layer.mlp
    rows = lambda *mods: [own_part(mod.weight, 0, rank, tp, mod.out_features) for mod in mods]  # noqa: E731
    cols = lambda mod: own_part(mod.weight, 1, rank, tp, mod.in_features)  # noqa: E731
    wd = {"weight_dtype": weight_dtype, "path": path}
    return _LayerWeights(
        ln1=layer.input_layernorm.weight.to(dtype),
        ln2=layer.post_attention_layernorm.weight.to(dtype),
        qkv=Linear(rows(a.q_proj, a.k_proj, a.v_proj), _cat_bias(a.q_proj, a.k_proj, a.v_proj, rank=rank, tp=tp), **wd),
        o=Linear(cols(a.o_proj), a.o_proj.bias if rank == 0 else None, **wd),
        gate_up=Linear(rows(m.gate_proj, m.up_proj), _cat_bias(m.gate_proj, m.up_proj, rank=rank, tp=tp), **wd),
        down=Linear(cols(m.down_proj), m.down_proj.bias if rank == 0 else None, **wd),
    )


@dataclass
class SharedPrefix:
    """Left-padded prompts re-laid out as one shared prefix [1, n] plus per-row suffixes [B, s]
    (left-padded, at least one token each)."""

    prefix_ids: Tensor
    prefix_pos: Tensor
    suffix_ids: Tensor
    suffix_mask: Tensor
    suffix_pos: Tensor


@dataclass
class _NewRows:
    """Where `StaticLlamaDecoder.extend`'s rows write and read in the slot cache."""

    slots: Tensor
    """[B] each row's sequence."""
    flat_slots: Tensor
    flat_cols: Tensor
    """[N] the sequence and column of each real (not padding) new id, row by row."""
    real: Tensor
    """[B, S] which of the rows' positions are real ids."""
    width: int
    """Columns the rows attend over (the longest row's end)."""


SHARED_PREFIX_MIN_SAVING = 64
"""Prefill the common prefix once only when that skips at least this many prompt tokens: below it the
extra forward call and cache copy cost about what they save."""


def shared_prefix(ids: Tensor, mask: Tensor, pos: Tensor) -> SharedPrefix | None:
    """The longest run of first tokens (and positions) that every row of left-padded prompts shares,
    leaving each row one token of its own, or None when sharing it would not pay."""
    b, p = ids.shape
    lengths = mask.sum(dim=1)
    m = int(lengths.min()) - 1
    if b < 2 or m * (b - 1) < SHARED_PREFIX_MIN_SAVING:
        return None
    cols = (p - lengths)[:, None] + torch.arange(m)
    head_ids, head_pos = ids.gather(1, cols), pos.gather(1, cols)
    same = ((head_ids == head_ids[:1]) & (head_pos == head_pos[:1])).all(dim=0)
    n = m if bool(same.all()) else int((~same).nonzero()[0])
    if n * (b - 1) < SHARED_PREFIX_MIN_SAVING:
        return None
    s = int(lengths.max()) - n
    # row i's suffix is its last lengths[i] - n real tokens; left-padded to s they are its last s columns
    return SharedPrefix(
        prefix_ids=head_ids[:1, :n],
        prefix_pos=head_pos[:1, :n],
        suffix_ids=ids[:, p - s :],
        suffix_mask=mask[:, p - s :].bool() & (torch.arange(s) >= s - (lengths - n)[:, None]),
        suffix_pos=pos[:, p - s :],
    )


class StaticLlamaDecoder:
    """Llama-style incremental decoder with a preallocated KV cache (see module docstring).

    Fused weights are built from the module at construction, so build a new
    decoder after the module's weights change (the native rollout builds one per call).
    `kernels`: the element-wise ops, eager or compiled (rollout/native/kernels.py). `weight_dtype`: bf16 to hold the
    products' weights in bf16 panels and compute in fp32 where the panel kernel runs (rollout/native/linear.py): an fp32
    model's weights rounded (rollout.weight_dtype), or a bf16 model's own (its activations and KV cache then fp32;
    its products in bf16 with fp32 sums where the CPU has avx512_bf16, `panel.DOT`).
    `fused`: run decode steps through decode_step.c where it covers the model (rollout/native/fused_step.py; None:
    `FUSED_DECODE`); the layer products are then laid out in the panels it multiplies with.
    """

    def __init__(
        self,
        model: nn.Module,
        kernels: DecoderKernels = EAGER,
        tp_group: dist.ProcessGroup | None = None,
        weight_dtype: torch.dtype | None = None,
        fused: bool | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.kernels = kernels
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        tp = dist.get_world_size(self.tp_group) if self.tp_group else 1
        rank = dist.get_rank(self.tp_group) if self.tp_group else 0
        if cfg.num_key_value_heads % tp:
            raise ValueError(
                f"rollout.tensor_model_parallel_size={tp} must divide num_attention_heads "
                f"({cfg.num_attention_heads}) and num_key_value_heads ({cfg.num_key_value_heads})"
            )
        fused = FUSED_DECODE if fused is None else fused
        path = fused_path(model, weight_dtype) if fused and self.tp_group is None else None
        self.dtype = compute_dtype(model.model.embed_tokens.weight.dtype, weight_dtype)  # activations, norms, cache
        self.layers = [_layer_weights(layer, self.dtype, rank, tp, weight_dtype, path) for layer in model.model.layers]
        self.final_norm = model.model.norm.weight.to(self.dtype)
        self._vocab_weights(model, rank, tp, weight_dtype)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.heads, self.kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        self.scaling = model.model.layers[0].self_attn.scaling
        self.eps = cfg.rms_norm_eps
        self.fused = FusedStep(self) if path is not None else None

    def _vocab_weights(self, model: nn.Module, rank: int, tp: int, weight_dtype: torch.dtype | None) -> None:
        """Embedding and LM head: whole, or with tp > 1 (when tp divides the vocabulary) this rank's rows."""
        embed, head = model.model.embed_tokens, model.lm_head
        self.vocab_split = tp > 1 and embed.num_embeddings % tp == 0
        if not self.vocab_split:
            self.embed, self.vocab_start = embed.weight, 0
            self.lm_head = Linear(head.weight, head.bias, weight_dtype=weight_dtype)
            return
        self.embed = own_part(embed.weight, 0, rank, tp, embed.num_embeddings)
        bias = None if head.bias is None else own_part(head.bias, 0, rank, tp, head.out_features)
        self.lm_head = Linear(own_part(head.weight, 0, rank, tp, head.out_features), bias, weight_dtype=weight_dtype)
        self.vocab_start = rank * (embed.num_embeddings // tp)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, max_new: int) -> Tensor:
        """Run the prompts [B, P]; reserve cache room for `max_new` more tokens; last-position logits.

        When the rows start with the same tokens (a chat template's system prompt: ~35 of the main
        job's ~46 prompt tokens), that prefix runs once and the rows' suffixes attend to its cache."""
        shared = shared_prefix(input_ids, attention_mask, position_ids)
        if shared is not None:
            return self._prefill_shared(shared, max_new)
        b, p = input_ids.shape
        self._allocate(b, p + max_new, int(position_ids.max()) + max_new + 1)
        self.key_mask[:, :p] = attention_mask.bool()
        return self._forward(input_ids, position_ids, self._prefill_mask(p, 0), 0)

    def _allocate(self, b: int, t_max: int, max_pos: int) -> None:
        shape = (len(self.layers), b, self.kv_heads, t_max, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, dtype=self.dtype)
        self.key_mask = torch.zeros(b, t_max, dtype=torch.bool)
        self.length = 0
        self.full_cache_decode = t_max <= FULL_CACHE_DECODE_MAX_LEN
        self._rope_table(max_pos)

    def _prefill_mask(self, s: int, start: int) -> Tensor:
        """[B, 1, group*s, start+s] mask of `s` new queries after `start` cached keys: the cache and the
        causal past where the key is not padding; padding queries attend to themselves so no softmax
        row is empty (NaN would leak into the cache)."""
        b, end = self.key_mask.shape[0], start + s
        causal = torch.ones(s, end, dtype=torch.bool).tril(diagonal=start)
        own = torch.zeros(s, end, dtype=torch.bool)
        own[:, start:] = torch.eye(s, dtype=torch.bool)
        mask = (causal & self.key_mask[:, None, :end]) | own
        group = self.heads // self.kv_heads
        return mask[:, None, None].expand(b, 1, group, s, end).reshape(b, 1, group * s, end)

    def _prefill_shared(self, shared: SharedPrefix, max_new: int) -> Tensor:
        b, (n, s) = shared.suffix_ids.shape[0], (shared.prefix_ids.shape[1], shared.suffix_ids.shape[1])
        max_pos = int(shared.suffix_pos.max()) + max_new + 1
        self._allocate(1, n, max_pos)
        self.key_mask[:, :n] = True
        self._forward(shared.prefix_ids, shared.prefix_pos, self._prefill_mask(n, 0), 0)
        k_prefix, v_prefix = self.k_cache, self.v_cache
        self._allocate(b, n + s + max_new, max_pos)
        self.k_cache[:, :, :, :n] = k_prefix
        self.v_cache[:, :, :, :n] = v_prefix
        self.key_mask[:, :n] = True
        self.key_mask[:, n : n + s] = shared.suffix_mask
        return self._forward(shared.suffix_ids, shared.suffix_pos, self._prefill_mask(s, n), n)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Append one token per row (`tokens` [B] at rotary `positions` [B]); next-token logits [B, V]."""
        self.key_mask[:, self.length] = True
        if self.fused is not None:
            x = self.fused(self, self._embed(tokens), positions)
            self.length += 1
            return self._logits(x)
        width = self.k_cache.shape[3] if self.full_cache_decode else self.length + 1
        mask = self.key_mask[:, None, None, :width]
        return self._forward(tokens[:, None], positions[:, None], mask, self.length)

    def select(self, rows: Tensor) -> None:
        """Keep (in this order, repeats allowed) only `rows` of the batch."""
        n = self.length
        for name in ("k_cache", "v_cache"):
            old = getattr(self, name)
            # zeros, not empty: full-cache decode multiplies the (masked) unwritten slots by 0, and 0 * NaN garbage is NaN
            new = old.new_zeros(old.shape[0], len(rows), *old.shape[2:])
            new[:, :, :, :n] = old[:, rows, :, :n]
            setattr(self, name, new)
        self.key_mask = self.key_mask[rows]

    # Sequences of their own lengths (the turn engine, rollout/native/turns.py): each of `slots` sequences keeps its
    # tokens from column 0 on, so a token's column is its rotary position, and grows by its own steps.

    def allocate_slots(self, slots: int, width: int) -> None:
        """An empty cache of `slots` sequences of up to `width` tokens each; one kept before is copied in (its
        sequences first, each up to its old width), so it may only grow."""
        old = (self.k_cache, self.v_cache, self.key_mask) if hasattr(self, "k_cache") else None
        self._allocate(slots, width, width)
        if old is not None:
            s, t = old[2].shape
            self.k_cache[:, :s, :, :t], self.v_cache[:, :s, :, :t], self.key_mask[:s, :t] = old

    def extend(self, slots: list[int], ids: list[list[int]], starts: list[int]) -> Tensor:
        """Run `ids[b]` as sequence `slots[b]`'s tokens from column `starts[b]` on, after its first `starts[b]`
        tokens (kept in the cache; later columns are dropped), every row in one forward (right-padded to the
        longest); each row's last token's logits [B, V]."""
        b, lens = len(slots), torch.tensor([len(r) for r in ids])
        if b == 0 or int(lens.min()) < 1:
            raise ValueError("extend needs at least one row, each with at least one id")
        s, rows, first = int(lens.max()), torch.tensor(slots), torch.tensor(starts)
        real = torch.arange(s)[None] < lens[:, None]  # [B, S]: not padding
        cols = first[:, None] + torch.arange(s)[None]  # [B, S]: each new id's column (= position)
        width = int((first + lens).max())
        self.key_mask[rows] = torch.arange(self.key_mask.shape[1])[None] < (first + lens)[:, None]
        keys = self.key_mask[rows, :width][:, None] & (torch.arange(width)[None, None] <= cols[:, :, None])
        keys[~real] = torch.arange(width) == 0  # padding queries attend to one real key (no empty softmax row)
        group = self.heads // self.kv_heads
        mask = keys[:, None, None].expand(b, 1, group, s, width).reshape(b, 1, group * s, width)
        padded = torch.tensor([r + [0] * (s - len(r)) for r in ids])
        new = _NewRows(rows, rows[:, None].expand(b, s)[real], cols[real], real, width)
        positions = cols.clamp(max=self.cos.shape[0] - 1)
        return self._forward(padded, positions, mask, 0, new, lens - 1)

    def copy_prefix(self, src: int, dsts: list[int], n: int) -> None:
        """Give the sequences `dsts` the first `n` tokens of sequence `src` (a prefix they share)."""
        rows = torch.tensor(dsts)
        self.k_cache[:, rows, :, :n] = self.k_cache[:, src : src + 1, :, :n]
        self.v_cache[:, rows, :, :n] = self.v_cache[:, src : src + 1, :, :n]
        self.key_mask[rows] = False
        self.key_mask[rows, :n] = True

    def step_rows(self, tokens: Tensor, slots: Tensor, cols: Tensor) -> Tensor:
        """Append `tokens[b]` to sequence `slots[b]` at column (= position) `cols[b]`, every row in one fused decode
        step (the sequences not in `slots` are left as they are); next-token logits [B, V]. Needs the fused step."""
        if self.fused is None:
            raise RuntimeError("step_rows needs the fused decode step (rollout/native/fused_step.py fused_path)")
        self.key_mask[slots, cols] = True
        return self._logits(self.fused(self, self._embed(tokens), cols, slots, cols))

    def _rope_table(self, max_pos: int) -> None:
        pos = torch.arange(max_pos)[None]
        cos, sin = self.model.model.rotary_emb(self.k_cache[0, :1, 0], pos)
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos[0].contiguous(), torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def _forward(
        self, ids: Tensor, positions: Tensor, mask: Tensor, start: int, new: _NewRows | None = None, last=None
    ) -> Tensor:
        """Logits of each row's last position (`last` [B]: of these positions); `new`: the rows are sequences of
        the slot cache, each writing at its own columns (`extend`), else every row writes at columns from `start`."""
        k, eps = self.kernels, self.eps
        h = self._embed(ids)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        # each residual add is fused with the norm that follows it (the next layer's; the final one last)
        after_attn = [w.ln2 for w in self.layers]
        after_mlp = [w.ln1 for w in self.layers[1:]] + [self.final_norm]
        x = k.rms_norm(h, self.layers[0].ln1, eps)
        for i, w in enumerate(self.layers):
            h, x = k.add_rms_norm(h, self._attention(i, w, x, cos, sin, mask, start, new), after_attn[i], eps)
            h, x = k.add_rms_norm(h, self._mlp(w, x), after_mlp[i], eps)
        if new is not None:
            return self._logits(x[torch.arange(len(x)), last])
        self.length = start + ids.shape[1]
        return self._logits(x[:, -1])

    def _embed(self, ids: Tensor) -> Tensor:
        """Token embeddings; with the vocabulary split, each rank looks up its own ids (zeros elsewhere)
        and an all-reduce sums them (adding zeros: exact)."""
        if not self.vocab_split:
            return F.embedding(ids, self.embed).to(self.dtype)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed).to(self.dtype).masked_fill_(outside[..., None], 0)
        dist.all_reduce(h, group=self.tp_group)
        return h

    def _logits(self, x: Tensor) -> Tensor:
        """fp32 logits [B, V]; with the vocabulary split, each rank's columns gathered."""
        logits = self.lm_head(x)
        if self.vocab_split:
            parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits.float()

    def _attention(
        self,
        i: int,
        w: _LayerWeights,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        start: int,
        new: _NewRows | None = None,
    ) -> Tensor:
        b, s, _ = x.shape
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        qkv = w.qkv(x).view(b, s, hq + 2 * hkv, d)
        qk = qkv[:, :, : hq + hkv]
        qk = self.kernels.rotary(qk, cos, sin)
        if new is not None:
            return self._attention_new_rows(i, w, qkv, qk, mask, new)
        end = start + s
        self.k_cache[i, :, :, start:end] = qk[:, :, hq:].transpose(1, 2)
        self.v_cache[i, :, :, start:end] = qkv[:, :, hq + hkv :].transpose(1, 2)
        # query head h uses kv head h // group: fold the group into the query-length axis
        q = qk[:, :, :hq].transpose(1, 2).reshape(b, hkv, (hq // hkv) * s, d)
        # a decode step's mask spans the whole cache; a one-token prefill suffix (rows that differ only in their
        # last prompt token, e.g. n identical prompts) has a narrower mask and takes the SDPA path
        if s == 1 and self.full_cache_decode and mask.shape[-1] == self.k_cache.shape[3]:
            out = _decode_attention(q, self.k_cache[i], self.v_cache[i], mask, self.scaling)
        else:
            k, v = self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        out = out.view(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d)
        return self._sum_over_tp(w.o(out))

    def _attention_new_rows(self, i: int, w: _LayerWeights, qkv: Tensor, qk: Tensor, mask: Tensor, new: _NewRows):
        """`_attention` of `extend`'s rows: the real ids' keys and values written at their own slots and columns,
        then every row's queries against its slot's first `new.width` columns."""
        b, s = qkv.shape[:2]
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        self.k_cache[i][new.flat_slots, :, new.flat_cols] = qk[:, :, hq:][new.real]
        self.v_cache[i][new.flat_slots, :, new.flat_cols] = qkv[:, :, hq + hkv :][new.real]
        k, v = self.k_cache[i][new.slots, :, : new.width], self.v_cache[i][new.slots, :, : new.width]
        q = qk[:, :, :hq].transpose(1, 2).reshape(b, hkv, (hq // hkv) * s, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        out = out.view(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d)
        return self._sum_over_tp(w.o(out))

    def _mlp(self, w: _LayerWeights, x: Tensor) -> Tensor:
        return self._sum_over_tp(w.down(self.kernels.silu_mul(w.gate_up(x))))

    def _sum_over_tp(self, partial: Tensor) -> Tensor:
        """The row-split projection's output: each tp rank holds a partial sum over its columns."""
        if self.tp_group is not None:
            dist.all_reduce(partial, group=self.tp_group)
        return partial


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of one new token per row: q [B, Hkv, G, D] against a contiguous cache [B, Hkv, T, D].

    Plain matmul + fp32 softmax (the numerics of transformers' eager attention); at one query
    per row it is ~2x faster than SDPA's CPU flash kernel on this model's shapes.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v)


class HFDecoder:
    """Any HF causal LM through its own forward and a DynamicCache (slower, fully general)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, max_new: int) -> Tensor:
        """Run the prompts [B, P]; last-position logits [B, V] (max_new is unused: the cache grows)."""
        self.cache = DynamicCache(config=self.model.config)
        self.mask = attention_mask
        return self._forward(input_ids, position_ids)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Append one token per row; next-token logits [B, V]."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        return self._forward(tokens[:, None], positions[:, None])

    def select(self, rows: Tensor) -> None:
        """Keep (in this order, repeats allowed) only `rows` of the batch."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]

    def _forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()
