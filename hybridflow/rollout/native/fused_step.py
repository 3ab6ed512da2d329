"""A `StaticLlamaDecoder` decode step through all its layers in one C call (decode_step.c).

Eager torch runs ~25 small ops a layer around a decode step's four products, each paying a dispatch: at 8 rows of
SmolLM2 in fp32 that was ~28% of the step (`bench/decode_profile.py`). `decode_step.c` runs the norms, rotary,
cache write, attention, SiLU gate and residuals in fp32 between the panel kernel's products, with no Python
between layers. It runs where the decoder's layer products are all panels of one kind (fp32; bf16 with fp32 math:
an fp32 model's weights with rollout.weight_dtype=bf16, or a bf16 model's own at a few rows; a bf16 model's own in
panels of column pairs with bf16 products where the CPU has avx512_bf16: rollout/native/rollout.py), on
one rank (no tensor-parallel group), with the hidden size, head size and MLP width multiples of 8 (`fused_path`);
elsewhere the decoder keeps its torch path. Prefill always runs the torch path. The logits agree with the torch
path's on the same panels to fp32 rounding (tests/test_rollout_fused_step.py).
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from hybridflow.rollout.native import panel


class StaticDecoder(Protocol):
    """What the fused step reads of a `decoder.StaticLlamaDecoder` (decoder.py builds the step from itself)."""

    model: nn.Module
    layers: list[Any]
    final_norm: Tensor
    head_dim: int
    heads: int
    kv_heads: int
    k_cache: Tensor
    v_cache: Tensor
    key_mask: Tensor
    cos: Tensor
    sin: Tensor
    eps: float
    scaling: float
    length: int


_KIND = {"panels": 0, "bf16_panels": 1, "bf16_dot": 2}
"""The layer products' path -> decode_step.c's `kind` of panels."""


def fused_path(model: nn.Module, weight_dtype: torch.dtype | None) -> str | None:
    """The panel layout (rollout/native/linear.py) the fused step multiplies with, where it covers a one-rank decoder of
    `model`: fp32, or bf16 held in bf16 panels (`weight_dtype` bf16; a bf16 model's own weights in `panel.DOT`'s
    panels of column pairs where that kernel was built), the step's C code built here, every layer
    product whole panels, the hidden size, head size and MLP width multiples of 8. Else None: no fused step, the
    decoder's own choice of layouts."""
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    if not (dtype == torch.float32 or dtype == weight_dtype == torch.bfloat16):
        return None
    if panel.kernel(panel.DECODE_STEP) is None:
        return None
    a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
    if any(p.out_features % panel.PANEL for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj)):
        return None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if any(n % 8 for n in (cfg.hidden_size, head_dim, cfg.intermediate_size)):
        return None
    if dtype == torch.bfloat16 and panel.kernel(panel.DOT) is not None:
        return "bf16_dot"
    return "bf16_panels" if weight_dtype == torch.bfloat16 else "panels"


class FusedStep:
    """The decode step of one decoder's weights, laid out in `fused_path`'s panels; call with the new tokens'
    embeddings [B, H] (overwritten with the residual stream) and their rotary positions [B]; returns the final norm
    of the last layer's output [B, H]. By default row b is the cache's sequence b and every row writes at column
    `dec.length`; `slots` [B] and `cols` [B] name each row's sequence and column instead (the turn engine's rows:
    rollout/native/turns.py)."""

    def __init__(self, dec: StaticDecoder) -> None:
        self.fn = panel.kernel(panel.DECODE_STEP)
        cfg = dec.model.config
        self.kind = _KIND[dec.layers[0].qkv.path]
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.final_norm = dec.final_norm.detach().contiguous()
        self.keep: list[Tensor] = [self.final_norm]  # every tensor the table points into stays alive with it
        table: list[int | None] = []
        for w in dec.layers:
            for part in (w.ln1, w.qkv, w.o, w.ln2, w.gate_up, w.down):
                if isinstance(part, Tensor):
                    table.append(self._hold(part.detach()))
                else:
                    table += [self._hold(part.panels), self._hold(None if part.bias is None else part.bias.detach())]
        self.table = (ctypes.c_void_p * len(table))(*table)

    def _hold(self, t: Tensor | None) -> int | None:
        if t is not None:
            self.keep.append(t.contiguous())
            return self.keep[-1].data_ptr()
        return None

    def __call__(
        self, dec: StaticDecoder, h: Tensor, positions: Tensor, slots: Tensor | None = None, cols: Tensor | None = None
    ) -> Tensor:
        b = h.shape[0]
        d, hq, hkv = dec.head_dim, dec.heads, dec.kv_heads
        x = torch.empty_like(h)
        scratch = torch.empty(b * ((hq + 2 * hkv) * d + hq * d + self.hidden + 3 * self.inter))
        pos = positions.to(torch.int64).contiguous()
        slots = (torch.arange(b) if slots is None else slots).to(torch.int64).contiguous()
        cols = (torch.full((b,), dec.length) if cols is None else cols).to(torch.int64).contiguous()
        self.fn(
            self.table,
            len(dec.layers),
            self.kind,
            h.data_ptr(),
            x.data_ptr(),
            b,
            self.hidden,
            hq,
            hkv,
            d,
            self.inter,
            dec.k_cache.data_ptr(),
            dec.v_cache.data_ptr(),
            dec.k_cache.shape[1],
            dec.k_cache.shape[3],
            dec.key_mask.data_ptr(),
            slots.data_ptr(),
            cols.data_ptr(),
            dec.cos.data_ptr(),
            dec.sin.data_ptr(),
            pos.data_ptr(),
            self.final_norm.data_ptr(),
            dec.eps,
            dec.scaling,
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
        return x
