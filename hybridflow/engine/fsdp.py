"""The training engine: one model, parallelised by `parallelize` (engine/parallel/parallelize.py) as `ParallelDims` lays
out the world (tensor parallel, Ulysses attention, checkpointing, FSDP2); without tp / sp, plain FSDP2. With
pipeline parallel each rank holds its stage and every call runs through a schedule (engine/parallel/pipeline.py).

Parameters, gradients and AdamW state are sharded over the ranks of the current torch.distributed world
(gloo on CPU, nccl on GPU). Compute runs in `param_dtype` through FSDP2's MixedPrecisionPolicy while the
sharded master weights and optimizer state stay fp32. Without an initialised process group the engine
starts a single-process one (world size 1, in-memory store, no ports), so one code path serves one
process and many.

Departures from a plain training loop, on purpose:
- Logits are computed only at the response positions (`logits_to_keep`), never
  for the prompt, and stay in `param_dtype`; log-probs and entropy are taken
  chunk-wise in fp32 (hybridflow/algos/logits.py).
- Gradients are reduce-scattered once per optimizer step, after the last
  micro-batch; the micro-batches before it accumulate unsharded gradients in
  `reduce_dtype` (FSDP2 upcasts them), trading memory for 1/n of the traffic.
- On CPU across ranks parameters stay gathered from forward to backward
  (`EngineConfig.reshard_after_forward` resolves to False there; gloo gathers
  over loopback cost more than the memory), and an inference call gathers each
  layer once for all its micro-batches and reshards at the end.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import hybridflow.engine.batch as B
from hybridflow.algos.logits import entropy_from_logits, logprobs_from_logits
from hybridflow.engine.base import Engine, LossFn, MicroBatch
from hybridflow.engine.checkpoint import load_checkpoint, save_checkpoint
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.engine.gather import gather_named, tied_aliases
from hybridflow.engine.optim import build_lr_scheduler, build_optimizer
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.engine.parallel.parallelize import decoder_layers, parallelize  # noqa: F401  (decoder_layers: re-exported)
from hybridflow.engine.parallel.pipeline import Pipeline, gather_stages
from hybridflow.engine.parallel.pipeline_stage import HeadSpec, split_stage
from hybridflow.engine.parallel.sequence_parallel import forward_sp_packed, sp_packed_row
from hybridflow.engine.prefix import pack_shared_prompts, sharing_pays
from hybridflow.engine.prefix_attention import LAYOUT_KWARG
from hybridflow.models import load_causal_lm, load_value_model
from hybridflow.models.loading import contiguous_lm_head_input
from hybridflow.models.value import ValueModel
from hybridflow.protocol import keys
from hybridflow.utils.device import compute_device, ensure_process_group
from hybridflow.utils.dtypes import dtype_of
from hybridflow.utils.memory import keep_freed_memory


def _refuse_value_lora(value_model: bool, lora: LoraConfig | None) -> None:
    if value_model and lora is not None and lora.enabled:
        raise ValueError(
            "LoRA adapters are supported on the policy (actor.lora) only; a value model (critic) trains all its weights"
        )


class FSDPEngine(Engine):
    """A causal LM or a `ValueModel`, parallelised over the current world as its `EngineConfig` lays it out
    (`ParallelDims`: FSDP2 over dp, and tensor / Ulysses sequence parallel; engine/parallel/parallelize.py).

    `rank` / `world_size` stay the global ones (checkpoints write per global rank); `dp_*`, `tp_*`, `sp_*` and
    `pp_rank` give this rank's place in the layout. Adapters (LoRA) are refused with tensor parallel (peft wraps the
    very projections it splits) and with pipeline parallel.

    Pass `optim=None` for an inference-only engine (reference policy, reward model), and
    `lora` with rank > 0 to train low-rank adapters on a causal LM instead of its weights
    (hybridflow/engine/lora.py).
    """

    dims: ParallelDims
    rank: int

    def __init__(
        self, model: nn.Module, config: EngineConfig, optim: OptimConfig | None = None, lora: LoraConfig | None = None
    ) -> None:
        ensure_process_group()
        self.config = config
        self.device = compute_device()
        if self.device.type == "cpu" and config.cpu_keep_freed_memory:
            keep_freed_memory()
        self._value = isinstance(model, ValueModel)
        self._lora = lora if lora is not None and lora.enabled else None
        _refuse_value_lora(self._value, self._lora)
        self.dims = ParallelDims.from_config(config, dist.get_world_size(), self.device)
        for key, size in (("tensor_parallel_size", self.dims.tp), ("pipeline_model_parallel_size", self.dims.pp)):
            if size > 1 and self._lora:
                raise ValueError(f"engine.{key}={size} does not combine with LoRA adapters (lora.rank > 0)")
        if self._lora:
            from hybridflow.engine.lora import apply_lora  # noqa: PLC0415  (lazy: peft, only LoRA runs need it)

            model = apply_lora(model, self._lora)
        contiguous_lm_head_input(model)
        if self.dims.pp > 1:
            model = split_stage(model, self.pp_rank, self.dims.pp)
        self.model = self._shard(model.to(self.device))
        self._optimizer = build_optimizer(self.model, optim) if optim else None
        self._lr_scheduler = build_lr_scheduler(self._optimizer, optim) if optim else None
        self.optim_config = optim

    # --- this rank's place in the layout ---------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Number of dp groups (distinct shards of the batch)."""
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        """Which shard of the batch this rank holds."""
        return self.dims.coords(self.rank).dp

    @property
    def tp_size(self) -> int:
        """Ranks each decoder layer is split over."""
        return self.dims.tp

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tp group."""
        return self.dims.coords(self.rank).tp

    @property
    def sp_size(self) -> int:
        """Ranks each micro-batch's tokens are split over."""
        return self.dims.sp

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sp group (which slice of the tokens it runs)."""
        return self.dims.coords(self.rank).sp

    @property
    def pipeline_stages(self) -> int:
        """Stages the decoder layers are split over (1: no pipeline parallel)."""
        return self.dims.pp

    @property
    def pp_rank(self) -> int:
        """The pipeline stage this rank holds (0: the embedding's, pp - 1: the head's)."""
        return self.dims.coords(self.rank).pp

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        config: EngineConfig,
        optim: OptimConfig | None = None,
        value_model: bool = False,
        lora: LoraConfig | None = None,
    ) -> FSDPEngine:
        """Load a causal LM (or, with `value_model`, a value model) from a local HF dir and shard it,
        with adapters when `lora` has rank > 0."""

        _refuse_value_lora(value_model, lora)  # before loading any weights
        model = load_value_model(path) if value_model else load_causal_lm(path)
        return cls(model, config, optim, lora)

    def _shard(self, model: nn.Module) -> nn.Module:
        built = parallelize(model, self.dims, self.config)
        self.dp_mesh, self.tp_mesh, self.sp = built.fsdp_mesh, built.tp_mesh, built.sp
        self._prefix_attention = built.prefix_attention
        self._reshard_after_forward = built.reshard_after_forward
        self.pipeline = None
        if self.dims.pp > 1:
            self.pipeline = Pipeline(model, built.pp_group, self.device, dtype_of(self.config.param_dtype))
        return model

    # --- properties -----------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        return self._lr_scheduler

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def is_value_model(self) -> bool:
        return self._value

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    @property
    def lora(self) -> LoraConfig | None:
        return self._lora

    def adapters_disabled(self) -> contextlib.AbstractContextManager[None]:
        """See `Engine.adapters_disabled`: peft's `disable_adapter()` on the wrapped model."""
        if not self.has_adapters:
            return super().adapters_disabled()
        return self._without_adapters()

    @contextlib.contextmanager
    def _without_adapters(self):
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        with self.model.disable_adapter():
            # peft also freezes the adapters, but FSDP2 copies requires_grad into each gathered parameter and
            # picks its gradient reduce dtype from the trainable ones at its first forward (which may be this
            # one): frozen here, they would stay frozen or reduce in bf16. Switching them off is enough.
            for p in trainable:
                p.requires_grad_(True)
            yield

    # --- forward --------------------------------------------------------------
    def forward_micro_batch(
        self, micro: MicroBatch, temperature: float = 1.0, calc_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        if self.pipeline is not None:
            raise RuntimeError(
                "with pipeline_model_parallel_size > 1 a micro-batch runs on every stage at once: "
                "use compute_log_probs / compute_values / train_step"
            )
        inputs = B.select_inputs(micro, self.device)
        if self.sp is not None:
            return self._forward_packed(sp_packed_row(inputs, self.config), temperature, calc_entropy)
        if self.config.packing:
            return self._forward_packed(B.pack(inputs), temperature, calc_entropy)
        if self.config.share_prompts and sharing_pays(inputs, self.model.config, not self._prefix_attention):
            return self._forward_packed(pack_shared_prompts(inputs), temperature, calc_entropy)
        win = B.response_window(inputs, self.config.use_remove_padding)
        rmask = B.response_mask_of(inputs)
        if self._value:
            values = self.model(**B.trim(inputs, win))
            first = win.prompt_len - 1 - win.start
            return {"values": B.pad_to_response(values[:, first : first + win.n_valid], win, rmask)}
        out = self.model(**B.trim(inputs, win), logits_to_keep=win.logits_to_keep, use_cache=False)
        labels = inputs[keys.RESPONSES][:, : win.n_valid]
        place = lambda v: B.pad_to_response(v, win, rmask)  # noqa: E731
        return self._token_outputs(out.logits[:, :-1], labels, place, temperature, calc_entropy)

    def _forward_packed(self, packed: B.PackedBatch, temperature: float, calc_entropy: bool) -> dict[str, torch.Tensor]:
        """The micro-batch as one packed row. Without an explicit mask (engine/batch.py `pack`) and
        without a cache, transformers masks attention block-diagonally from the restarting position
        ids; shared-prompt packing (engine/prefix.py) brings its own 4-D mask."""
        if self.sp is not None:
            outputs = lambda logits, labels, place: self._token_outputs(  # noqa: E731
                logits, labels, place, temperature, calc_entropy
            )
            return forward_sp_packed(self.model, self.sp, packed, self._value, outputs)
        row = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
        if packed.attention_mask is not None:
            row["attention_mask"] = packed.attention_mask
        if packed.prefix is not None and self._prefix_attention:
            row[LAYOUT_KWARG] = packed.prefix
        place = lambda v: B.unpack_to_response(v, packed)  # noqa: E731
        if self._value:
            return {"values": place(self.model(**row, use_cache=False)[0, packed.predictors])}
        out = self.model(**row, logits_to_keep=packed.predictors, use_cache=False)
        return self._token_outputs(out.logits[0], packed.labels, place, temperature, calc_entropy)

    def _token_outputs(
        self, logits: torch.Tensor, labels: torch.Tensor, place: Any, temperature: float, calc_entropy: bool
    ) -> dict[str, torch.Tensor]:
        """log-probs (and entropy) of `labels` under `logits`, put back in the [b, R] layout by `place`."""
        if temperature != 1.0:
            logits = logits.float() / temperature
        chunk = self.config.logits_chunk_size
        result = {"log_probs": place(logprobs_from_logits(logits, labels, chunk))}
        if calc_entropy:
            result["entropy"] = place(entropy_from_logits(logits, chunk))
        return result

    @torch.no_grad()
    def _infer(
        self, data: Mapping[str, torch.Tensor], micro_batch_size: B.MicroBatchSize, **kw
    ) -> dict[str, torch.Tensor]:
        """Forward only, on the engine's device; the outputs come back on the host, as the batch came."""
        self.model.eval()
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        # Keep each layer gathered across micro-batches; reshard so no stale copy outlives the call.
        fsdp = isinstance(self.model, FSDPModule)
        if fsdp:
            self.model.set_reshard_after_forward(False)
        try:
            micros = B.split_micro_batches(B.select_inputs(data, self.device), micro_batch_size)
            if self.pipeline is not None:
                spec = HeadSpec(0, chunk=self.config.logits_chunk_size, **kw)
                outputs = self.pipeline.infer(micros, spec, self.config.use_remove_padding)
                return {k: v.cpu() for k, v in outputs.items()}
            for micro in micros:
                for k, v in self.forward_micro_batch(micro, **kw).items():
                    parts[k].append(v)
        finally:
            if fsdp:
                self.model.reshard()
                self.model.set_reshard_after_forward(self._reshard_after_forward)
        return {k: torch.cat(v).cpu() for k, v in parts.items()}

    def compute_log_probs(
        self,
        data: Mapping[str, torch.Tensor],
        micro_batch_size: B.MicroBatchSize,
        temperature: float = 1.0,
        calc_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._value:
            raise TypeError("compute_log_probs needs a causal LM; this engine holds a value model")
        out = self._infer(data, micro_batch_size, temperature=temperature, calc_entropy=calc_entropy)
        return out["log_probs"], out.get("entropy")

    def compute_values(self, data: Mapping[str, torch.Tensor], micro_batch_size: B.MicroBatchSize) -> torch.Tensor:
        if not self._value:
            raise TypeError("compute_values needs a value model; build the engine with value_model=True")
        return self._infer(data, micro_batch_size)["values"]

    # --- training -------------------------------------------------------------
    def train_step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        temperature: float = 1.0,
        calc_entropy: bool = False,
    ) -> dict[str, float]:
        """See `Engine.train_step`; `temperature`/`calc_entropy` go to `forward_micro_batch`."""
        if self.optimizer is None:
            raise RuntimeError("train_step needs an optimizer; build the engine with an OptimConfig")
        self.model.train()
        if self.pipeline is not None:
            return self._pipeline_train_step(micro_batches, loss_fn, temperature, calc_entropy)
        collected: dict[str, list[float]] = defaultdict(list)
        total_loss = 0.0
        for i, micro in enumerate(micro_batches):
            self._set_grad_sync(i == len(micro_batches) - 1)
            micro = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in micro.items()}
            # Backward inside the same kernel choice: gradient checkpointing recomputes the forward there.
            with self._training_attention(micro):
                outputs = self.forward_micro_batch(micro, temperature=temperature, calc_entropy=calc_entropy)
                loss, stats = loss_fn(outputs, micro)
                loss.backward()
            total_loss += float(loss.detach())
            for k, v in stats.items():
                collected[k].append(float(v))
        return self._step_metrics(collected, total_loss)

    def _pipeline_train_step(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, temperature: float, calc_entropy: bool
    ) -> dict[str, float]:
        micros = [{k: v.to(self.device) if torch.is_tensor(v) else v for k, v in m.items()} for m in micro_batches]
        spec = HeadSpec(0, temperature=temperature, calc_entropy=calc_entropy, chunk=self.config.logits_chunk_size)
        with self._training_attention(micros[0]):
            run = self.pipeline.train(micros, spec, loss_fn, self.config.use_remove_padding)
        return self._step_metrics(run["stats"], run["loss"])

    def _step_metrics(self, collected: Mapping[str, list[float]], total_loss: float) -> dict[str, float]:
        metrics = {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in collected.items()}
        metrics.update(self._optimizer_step(), loss=total_loss)
        return metrics

    def _training_attention(self, micro: MicroBatch) -> contextlib.AbstractContextManager:
        """SDPA's math kernel for short CPU micro-batches (its backward beats the CPU flash kernel's there)."""
        width = micro[keys.INPUT_IDS].shape[1]
        if self.device.type == "cpu" and width <= self.config.cpu_math_attention_max_len:
            return sdpa_kernel([SDPBackend.MATH])
        return contextlib.nullcontext()

    def _set_grad_sync(self, sync: bool) -> None:
        """Reduce-scatter gradients in the coming backward (last micro-batch) or accumulate them (a plain module
        on one rank always accumulates: there is nothing to reduce)."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(sync)

    def _optimizer_step(self) -> dict[str, float]:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self._clip_grads(params, self.optim_config.grad_clip)
        finite = bool(torch.isfinite(torch.tensor(norm)))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "update_skipped": 0.0 if finite else 1.0, "lr": self.lr}

    def _clip_grads(self, params: list[nn.Parameter], clip: float) -> float:
        """The global gradient norm before clipping; scales the gradients to at most `clip` when clip > 0."""
        if self.pipeline is not None:
            return self.pipeline.clip_grads(params, clip)
        # foreach=False: the foreach norm is ~4x slower on CPU with DTensor gradients.
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=False)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=False)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def lr_scheduler_step(self) -> float:
        if self.lr_scheduler is None:
            raise RuntimeError("lr_scheduler_step needs an optimizer; build the engine with an OptimConfig")
        self.lr_scheduler.step()
        return self.lr

    # --- weights and checkpoints ---------------------------------------------
    def full_state_dict(self, dtype: torch.dtype | None = None, changed_only: bool = False) -> dict[str, torch.Tensor]:
        """See `Engine.full_state_dict`; fp32 master weights unless `dtype`, value models under their HF names."""
        if self._lora:
            from hybridflow.engine.lora import merged_state_dict  # noqa: PLC0415  (lazy: peft, only LoRA runs need it)

            return merged_state_dict(self.model, dtype, changed_only)
        prefix = "backbone." if self._value else ""
        named = {name.removeprefix(prefix): t for name, t in self.model.state_dict().items()}
        full = gather_named(named, dtype, tied_aliases(self.model.config, named))
        return full if self.pipeline is None else gather_stages(full, self.pipeline.group)

    def hf_config(self) -> Any:
        """The HF config of the model (for exports)."""
        return self.model.config

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        return save_checkpoint(self, Path(path), extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        return load_checkpoint(self, Path(path))
