"""Native rollout: our own batched sampler with a KV cache over an HF causal LM.

One prefill per prompt, then the prompt's cache rows are repeated for its n samples
(prompts are not re-encoded n times). Each step samples one token per row with
`sampling.sample_next` (greedy / temperature / top-k / top-p; log-probs as
documented there) from a seeded torch.Generator, so the same seed, weights and
inputs give the same samples. A row stops at the first sampled EOS (any id of
`eos_token_ids`). Finished rows leave the batch: once at least `COMPACT_FRACTION`
of the rows held are finished, the cache is compacted to the live rows. (Copying
the cache on every single finish costs more than computing a few dead rows for a
few steps; until compaction their samples are discarded.)

Llama-style models (Llama, Qwen2) run on `StaticLlamaDecoder`; other architectures
fall back to `HFDecoder` (the model's own forward with a DynamicCache). With
rollout.enforce_eager=False the static decoder's element-wise ops are compiled (rollout/native/kernels.py);
in fp32 on the panel kernel its decode steps are one C call each (rollout/native/fused_step.py). A bf16 model runs
that way too, on its own weights in bf16 panels: with bf16 products and fp32 sums where the CPU has avx512_bf16
(`panel.DOT`), else with fp32 math at most `BF16_PANEL_MAX_ROWS` rows.
With a tensor-parallel group (rollout.tensor_model_parallel_size > 1) the module keeps only this rank's
shard of the split weights (rollout/native/sharding.py); the weight sync reshards the actor into them.
Multi-turn (`turn_generator`): where the decode step is the fused one, the turn engine of rollout/native/turns.py
(each trajectory's KV cache kept across turns, trajectories joining and leaving the running batch while tools run);
elsewhere `ModuleRollout`'s rounds of `generate_sequences`.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.engine.reshard import GenerationLayout
from hybridflow.protocol import token_hash as parity_tokens
from hybridflow.rollout.base import ModuleRollout
from hybridflow.rollout.config import RolloutConfig, SamplingParams
from hybridflow.rollout.native import decoder, panel
from hybridflow.rollout.native.decoder import HFDecoder, StaticLlamaDecoder, supports_static_path
from hybridflow.rollout.native.fused_step import fused_path
from hybridflow.rollout.native.kernels import decoder_kernels
from hybridflow.rollout.native.sharding import own_part, shard_module_, split_dims
from hybridflow.rollout.native.turns import NativeTurnEngine
from hybridflow.rollout.sampling import sample_next
from hybridflow.utils.memory import release_freed_memory

log = logging.getLogger(__name__)

COMPACT_FRACTION = 0.125
"""Compact the batch once this fraction of the held rows has finished."""

BF16_PANEL_MAX_ROWS = 16
"""On a CPU without bf16 products (`panel.DOT`), a bf16 model decoding at most this many rows (prompts x n) runs its
decode steps in one C call on its own weights in bf16 panels, fp32 math (rollout/native/fused_step.py), where that covers
it; more rows run oneDNN's bf16 products. Measured with fp32 math on an AMD EPYC with avx512_bf16 (before the bf16
products): the first gave 1.56x / 1.12x the second's tokens/s at 8 / 16 rows and 0.82x / 0.76x at
32 / 64 (`bench/rollout.py --weight-dtype bf16`, BENCHMARKS.md)."""


class NativeRollout(ModuleRollout):
    """Batched KV-cache sampler (see module docstring)."""

    def __init__(
        self,
        config: RolloutConfig,
        model: nn.Module,
        tokenizer,
        use_static: bool | None = None,
        tp_group: dist.ProcessGroup | None = None,
        tp_stride: int = 1,
    ) -> None:
        super().__init__(config, model, tokenizer)
        self.use_static = supports_static_path(model) if use_static is None else use_static
        self.tp_group = tp_group
        if tp_group is not None and dist.get_world_size(tp_group) > 1 and not self.use_static:
            raise ValueError(
                "rollout.tensor_model_parallel_size > 1 needs a Llama/Qwen2-style model (the native "
                f"static decoder); {type(model).__name__} runs on the unsplit HF fallback"
            )
        self._eos = torch.tensor(self.eos_ids)
        self.kernels = decoder_kernels(compile=self.use_static and not config.enforce_eager)
        if config.weight_dtype == "bf16" and panel.kernel(torch.bfloat16) is None:
            log.warning(
                "rollout.weight_dtype=bf16 needs the AVX2 panel kernel, which cannot run here: weights stay fp32"
            )
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_stride = tp_stride  # how far apart the group's ranks are (rollout/base.py tensor_parallel_group)
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.split_dims = split_dims(model, self.tp_size) if self.tp_size > 1 else {}
        # from here on this rank holds only its generation shard of the decoder layers
        self._full_sizes = shard_module_(model, self.split_dims, self.tp_rank, self.tp_size)
        if self.tp_size > 1:
            release_freed_memory()  # the full weights just freed, which malloc may be set to keep (utils/memory.py)

    def load_weights(self, state_dict: dict[str, Tensor], partial: bool = False) -> None:
        """See `ModuleRollout.load_weights`; with tp > 1 each split weight may come whole (this rank's
        chunk is taken) or as this rank's shard (what `engine/reshard.py` produces)."""
        if self.tp_size > 1:
            state_dict = {name: self.as_held(name, t) for name, t in state_dict.items()}
        super().load_weights(state_dict, partial)

    def _check_turn_inputs(self, batch: list[list[int]], budgets: list[int]) -> None:
        """With tp > 1 every rank of the group runs the agent loop on the same rows with the same seed, so each
        round's contexts must be the same on all of them (the split decode steps are collectives): raise, on every
        rank, naming the cause where an environment answered differently on another rank."""
        if self.tp_size == 1:
            return
        mine = parity_tokens.hash_list_rows([[len(ids), budget, *ids] for ids, budget in zip(batch, budgets)])
        mine = torch.cat([torch.tensor([len(batch)]), mine])
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.tp_size)]
        dist.all_gather(sizes, torch.tensor([len(mine)]), group=self.tp_group)
        if len({int(n) for n in sizes}) == 1:
            gathered = [torch.empty_like(mine) for _ in range(self.tp_size)]
            dist.all_gather(gathered, mine, group=self.tp_group)
            if all(torch.equal(g, mine) for g in gathered):
                return
        raise RuntimeError(
            "rollout.multi_turn with rollout.tensor_model_parallel_size="
            f"{self.tp_size}: the ranks of a tensor-parallel group reached a round of the agent loop with different "
            "token contexts. Every rank runs the environments of the same rows; an environment whose replies differ "
            "between runs (time, randomness, a tool timing out on one rank) cannot run split: make it deterministic "
            "or set rollout.tensor_model_parallel_size=1"
        )

    def as_held(self, name: str, t: Tensor) -> Tensor:
        """See `Rollout.as_held`: this rank's chunk of a split weight sent whole (a shard is kept as is)."""
        if name not in self.split_dims:
            return t
        return own_part(t, self.split_dims[name], self.tp_rank, self.tp_size, self._full_sizes[name])

    def generation_layout(self) -> GenerationLayout | None:
        """How this rollout lays out its weights over the ranks (None with tp = 1: every rank all of them)."""
        if self.tp_size == 1:
            return None
        return GenerationLayout(tp=self.tp_size, split_dims=self.split_dims, stride=self.tp_stride)

    def shard_tensors(self) -> dict[str, Tensor]:
        """The tensors `load_weights` writes, by name (this rank's shards of the split weights, the rest
        whole), for a reshard that writes straight into them."""
        return self.held_weights()

    def turn_generator(
        self, sampling: SamplingParams, interruptible: bool = False
    ) -> contextlib.AbstractContextManager:
        """See `Rollout.turn_generator`: the turn engine (rollout/native/turns.py: KV cache kept across turns, tools
        overlapping decoding) where it covers the model, else `ModuleRollout`'s round path. `interruptible`: the
        round path, whose calls a push may cut (the engine's decoder holds the weights it was built with)."""
        engine = None if interruptible else self.turn_engine(sampling)
        return super().turn_generator(sampling) if engine is None else contextlib.nullcontext(engine)

    def turn_engine(self, sampling: SamplingParams, reuse_kv: bool = True) -> NativeTurnEngine | None:
        """A turn engine over a fresh decoder (the weights as they are now), or None where the decoder's decode step
        is not the fused one (rollout/native/turns.py). `reuse_kv=False`: every turn runs its whole context."""
        if not self.use_static or self.tp_size > 1:
            return None
        dec = self._decoder(self.config.max_batch_size)
        if dec.fused is None:
            return None
        eos = None if self.config.ignore_eos else self.eos_ids
        cfg = self.config
        return NativeTurnEngine(dec, sampling, self.generator, eos, cfg.max_batch_size, cfg.response_length, reuse_kv)

    def _decoder(self, rows: int = 0) -> StaticLlamaDecoder | HFDecoder:
        """The decoder of one generate call of `rows` rows (prompts x n; 0: unknown)."""
        # built per call: the static decoder's fused weights must follow in-place weight updates
        if self.use_static:
            bf16_panels = self.config.weight_dtype == "bf16" or self._bf16_on_panels(rows)
            return StaticLlamaDecoder(self.model, self.kernels, self.tp_group, torch.bfloat16 if bf16_panels else None)
        return HFDecoder(self.model)

    def _bf16_on_panels(self, rows: int) -> bool:
        """Whether a bf16 model decodes `rows` rows in the fused step on its weights in bf16 panels: at any
        number of rows with bf16 products (`panel.DOT`), at most `BF16_PANEL_MAX_ROWS` with fp32 math."""
        if self.tp_size > 1 or not decoder.FUSED_DECODE or self.model.dtype != torch.bfloat16:
            return False
        path = fused_path(self.model, torch.bfloat16)
        return path == "bf16_dot" or (path is not None and 0 < rows <= BF16_PANEL_MAX_ROWS)

    def _generate(
        self, ids: Tensor, mask: Tensor, pos: Tensor, params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        width = self.config.response_length
        dec = self._decoder(len(ids) * params.n)
        logits = dec.prefill(ids, mask, pos, width)
        if params.n > 1:
            expand = torch.arange(len(ids)).repeat_interleave(params.n)
            dec.select(expand)
            logits = logits[expand]
        rows = len(logits)
        state = _DecodeState(rows, width, self.pad_id, pos[:, -1].repeat_interleave(params.n) + 1)
        for t in range(width):
            tokens, logp = sample_next(logits, params, self.generator)
            state.record(t, tokens, logp, None if self.config.ignore_eos else self._eos)
            if self.tp_size == 1 and self.interrupted.is_set():  # ModuleRollout.interrupted
                state.end_live_rows(t)
                break
            if t == width - 1 or state.all_finished():
                break
            if state.should_compact():
                dec.select(state.compact())
                tokens = tokens[state.last_keep]
            logits = dec.step(tokens, state.positions + t)
        return state.outputs()


class _DecodeState:
    """Bookkeeping of one decode loop: which output row each held row is, who finished."""

    def __init__(self, rows: int, width: int, pad_id: int, positions: Tensor) -> None:
        self.responses = torch.full((rows, width), pad_id, dtype=torch.long)
        self.sampled_hash = torch.zeros(rows, dtype=torch.long)  # protocol/token_hash.py, accumulated as ids are drawn
        self._g = parity_tokens.position_weights(width)
        self.log_probs = torch.zeros(rows, width, dtype=torch.float32)
        self.lengths = torch.full((rows,), width, dtype=torch.long)
        self.out_row = torch.arange(rows)
        self.finished = torch.zeros(rows, dtype=torch.bool)
        self.positions = positions
        self.last_keep = self.out_row

    def record(self, t: int, tokens: Tensor, logp: Tensor, eos: Tensor | None) -> None:
        """Store step t's samples of the live rows and mark rows that sampled EOS."""
        live = ~self.finished
        out = self.out_row[live]
        self.responses[out, t] = tokens[live]
        term = (tokens[live].long().cpu() + 1) % parity_tokens.MOD * self._g[t] % parity_tokens.MOD
        self.sampled_hash[out] = (self.sampled_hash[out] + term) % parity_tokens.MOD
        self.log_probs[out, t] = logp[live]
        if eos is not None:
            ended = live & torch.isin(tokens, eos)
            self.lengths[self.out_row[ended]] = t + 1
            self.finished |= ended

    def end_live_rows(self, t: int) -> None:
        """End every row still running after step t (an interrupted generation)."""
        self.lengths[self.out_row[~self.finished]] = t + 1
        self.finished[:] = True

    def all_finished(self) -> bool:
        """True when every held row has finished."""
        return bool(self.finished.all())

    def should_compact(self) -> bool:
        """True when enough held rows are finished to be worth dropping."""
        done = int(self.finished.sum())
        return done > 0 and done >= COMPACT_FRACTION * len(self.finished)

    def compact(self) -> Tensor:
        """Drop finished rows; returns the kept row indices (also in `last_keep`)."""
        keep = (~self.finished).nonzero().squeeze(1)
        self.out_row, self.positions = self.out_row[keep], self.positions[keep]
        self.finished = self.finished[keep]
        self.last_keep = keep
        return keep

    def outputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(responses, response_mask, log_probs), each [rows, width], and the hash of each row's sampled ids [rows]."""
        width = self.responses.shape[1]
        mask = (torch.arange(width)[None] < self.lengths[:, None]).long()
        return self.responses, mask, self.log_probs * mask, self.sampled_hash
