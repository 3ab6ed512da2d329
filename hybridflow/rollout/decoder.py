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
  objects, output dataclasses) that dominates small models on CPU.
- `HFDecoder`: any HF causal LM through its own forward and a DynamicCache
  (the fallback for architectures the static path does not cover).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache

_FAST_MODEL_TYPES = ("llama", "qwen2")


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
    qkv_w: Tensor
    qkv_b: Tensor | None
    o_w: Tensor
    o_b: Tensor | None
    ln2: Tensor
    gate_up_w: Tensor
    gate_up_b: Tensor | None
    down_w: Tensor
    down_b: Tensor | None


def _cat_bias(*mods: nn.Linear) -> Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in mods])


def _layer_weights(layer: nn.Module) -> _LayerWeights:
    a, m = layer.self_attn, layer.mlp
    return _LayerWeights(
        ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
        qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
        qkv_b=_cat_bias(a.q_proj, a.k_proj, a.v_proj), o_w=a.o_proj.weight, o_b=a.o_proj.bias,
        gate_up_w=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
        gate_up_b=_cat_bias(m.gate_proj, m.up_proj), down_w=m.down_proj.weight, down_b=m.down_proj.bias,
    )


def _swap_halves(x: Tensor) -> Tensor:
    """(x1, x2) -> (x2, x1) on the last dim; with a sign-flipped sin table this is rotate_half."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


class StaticLlamaDecoder:
    """Llama-style incremental decoder with a preallocated KV cache (see module docstring).

    Fused weights are built from the module at construction, so build a new
    decoder after the module's weights change (the native rollout builds one per call).
    """

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.layers = [_layer_weights(layer) for layer in model.model.layers]
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = model.model.layers[0].self_attn.scaling
        self.eps = cfg.rms_norm_eps
        self.dtype = model.model.embed_tokens.weight.dtype

    def prefill(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, max_new: int) -> Tensor:
        """Run the prompts [B, P]; reserve cache room for `max_new` more tokens; last-position logits."""
        b, p = input_ids.shape
        t_max = p + max_new
        shape = (len(self.layers), b, self.kv_heads, t_max, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, dtype=self.dtype)
        self.key_mask = torch.zeros(b, t_max, dtype=torch.bool)
        self.key_mask[:, :p] = attention_mask.bool()
        self.length = p
        self._rope_table(int(position_ids.max()) + max_new + 1)
        causal = torch.ones(p, p, dtype=torch.bool).tril()
        # padding queries attend to themselves so no softmax row is empty (NaN would leak into the cache)
        mask = (causal & self.key_mask[:, None, :p]) | torch.eye(p, dtype=torch.bool)
        group = self.heads // self.kv_heads
        mask = mask[:, None, None].expand(b, 1, group, p, p).reshape(b, 1, group * p, p)
        return self._forward(input_ids, position_ids, mask, 0)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Append one token per row (`tokens` [B] at rotary `positions` [B]); next-token logits [B, V]."""
        self.key_mask[:, self.length] = True
        mask = self.key_mask[:, None, None, : self.length + 1]
        return self._forward(tokens[:, None], positions[:, None], mask, self.length)

    def select(self, rows: Tensor) -> None:
        """Keep (in this order, repeats allowed) only `rows` of the batch."""
        n = self.length
        for name in ("k_cache", "v_cache"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], len(rows), *old.shape[2:])
            new[:, :, :, :n] = old[:, rows, :, :n]
            setattr(self, name, new)
        self.key_mask = self.key_mask[rows]

    def _rope_table(self, max_pos: int) -> None:
        pos = torch.arange(max_pos)[None]
        cos, sin = self.model.model.rotary_emb(self.k_cache[0, :1, 0], pos)
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)

    def _forward(self, ids: Tensor, positions: Tensor, mask: Tensor, start: int) -> Tensor:
        emb = self.model.model.embed_tokens.weight
        h = F.embedding(ids, emb)
        cos, sin = self.cos[positions][:, :, None], self.sin[positions][:, :, None]
        for i, w in enumerate(self.layers):
            h = h + self._attention(i, w, self._norm(h, w.ln1), cos, sin, mask, start)
            h = h + self._mlp(w, self._norm(h, w.ln2))
        self.length = start + ids.shape[1]
        h = self._norm(h[:, -1], self.model.model.norm.weight)
        return F.linear(h, self.model.lm_head.weight, self.model.lm_head.bias).float()

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def _attention(self, i: int, w: _LayerWeights, x: Tensor, cos: Tensor, sin: Tensor,
                   mask: Tensor, start: int) -> Tensor:
        b, s, _ = x.shape
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(x, w.qkv_w, w.qkv_b).view(b, s, hq + 2 * hkv, d)
        qk = qkv[:, :, : hq + hkv]
        qk = qk * cos + _swap_halves(qk) * sin
        end = start + s
        self.k_cache[i, :, :, start:end] = qk[:, :, hq:].transpose(1, 2)
        self.v_cache[i, :, :, start:end] = qkv[:, :, hq + hkv :].transpose(1, 2)
        # query head h uses kv head h // group: fold the group into the query-length axis
        q = qk[:, :, :hq].transpose(1, 2).reshape(b, hkv, (hq // hkv) * s, d)
        out = F.scaled_dot_product_attention(
            q, self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end], attn_mask=mask, scale=self.scaling
        )
        out = out.view(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d)
        return F.linear(out, w.o_w, w.o_b)

    def _mlp(self, w: _LayerWeights, x: Tensor) -> Tensor:
        gate, up = F.linear(x, w.gate_up_w, w.gate_up_b).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.down_w, w.down_b)


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
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()
