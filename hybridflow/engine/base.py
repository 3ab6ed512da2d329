"""The Engine interface: how one model trains and infers on its process group.

Role workers (actor, critic, reference, reward model) are written once over this
interface; backends (FSDP2 here, tensor parallel later) implement it. Every method
works on THIS rank's shard of the batch, SPMD: all ranks of the group call the same
method with the same number of micro-batches, because parameters are gathered
collectively inside the forward and gradients are reduced inside the backward.

Batch layout (hybridflow/protocol/keys.py): `input_ids`, `attention_mask`, `position_ids`
are [B, T] with prompts left-padded and responses right-padded, `responses` is
[B, R], and per-token outputs (log-probs, entropy, values) are [B, R], aligned with
`responses`: the logits at columns P-1 .. T-2 (P = T - R) predict the response
tokens at columns P .. T-1. Entries past a row's last valid token are 0.

How an engine runs a micro-batch is its own business as long as the outputs keep that
layout: padded as given, trimmed of shared padding columns (`use_remove_padding`), or
packed (`EngineConfig.packing`): all rows' real tokens concatenated into one row with
position ids restarting at 0 per example, attention kept inside each example, outputs
scattered back to [b, R] (hybridflow/engine/batch.py `pack` / `unpack_to_response`).
Callers never see the difference, except in speed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridflow.engine.batch import MicroBatchSize
from hybridflow.engine.config import LoraConfig

MicroBatch = Mapping[str, torch.Tensor]
"""One micro-batch: at least input_ids, attention_mask, position_ids [b, T] and responses [b, R]."""

LossFn = Callable[[dict[str, torch.Tensor], MicroBatch], tuple[torch.Tensor, dict[str, float]]]
"""loss_fn(outputs, micro) -> (scalar loss, detached metrics). The loss must already be
scaled for accumulation over micro-batches and ranks (e.g. sum of token losses divided by
the global token count, times the data-parallel size); the engine does not rescale it."""


class Engine(ABC):
    """One model (policy or value) on one process group: inference, training, checkpoints."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's global rank (checkpoints name their per-rank files by it; with tensor parallel the
        data-parallel and tensor-parallel ranks are `dp_rank` / `tp_rank` of that engine)."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks the model is sharded over."""

    @property
    @abstractmethod
    def is_value_model(self) -> bool:
        """True for a critic (per-token values), False for a causal LM (log-probs)."""

    @abstractmethod
    def forward_micro_batch(
        self, micro: MicroBatch, temperature: float = 1.0, calc_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """Forward one micro-batch WITH autograd.

        Returns {"log_probs": [b, R]} (+ {"entropy": [b, R]} when `calc_entropy`) for a
        causal LM, with logits divided by `temperature` first; {"values": [b, R]} for a
        value model. All fp32, zero past each row's valid length.
        """

    @abstractmethod
    def compute_log_probs(
        self,
        data: Mapping[str, torch.Tensor],
        micro_batch_size: MicroBatchSize,
        temperature: float = 1.0,
        calc_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, R] of `responses` (and entropy [B, R] or None), without grad, in micro-batches of
        `micro_batch_size` rows or by a `TokenBudget` (hybridflow/engine/batch.py)."""

    @abstractmethod
    def compute_values(self, data: Mapping[str, torch.Tensor], micro_batch_size: MicroBatchSize) -> torch.Tensor:
        """Values V(s_t) [B, R] of a value model, without grad (micro-batches as compute_log_probs)."""

    @abstractmethod
    def train_step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        temperature: float = 1.0,
        calc_entropy: bool = False,
    ) -> dict[str, float]:
        """One optimizer step: forward + `loss_fn` + backward per micro-batch, then clip and step.

        `temperature` and `calc_entropy` go to `forward_micro_batch` (the outputs `loss_fn` sees).

        Returns the mean of each `loss_fn` metric over micro-batches (the largest for a name ending in
        "_max"), plus "loss" (sum of
        the micro-batch losses), "grad_norm" (before clipping) and "update_skipped" (1.0
        when the norm was not finite and the step was skipped). Does not touch the LR
        schedule: call `lr_scheduler_step` once per training step.
        """

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step; return the new learning rate."""

    @property
    @abstractmethod
    def lr(self) -> float:
        """Current learning rate."""

    @abstractmethod
    def full_state_dict(self, dtype: torch.dtype | None = None, changed_only: bool = False) -> dict[str, torch.Tensor]:
        """Gathered full weights under HF names, on every rank, as plain tensors.

        Collective: every rank must call it. Meant for syncing weights into a rollout
        model in the same process. `dtype` (None: the master weights' own) is applied
        before gathering, so a bf16 rollout costs half the traffic of an fp32 gather.
        With adapters the weights are merged (W + alpha / r * B @ A) under the base names,
        and `changed_only` keeps only the adapted layers' (the rest never changes); without
        adapters every weight trains, and `changed_only` changes nothing.
        """

    # --- adapters (LoRA): an engine without them keeps these defaults ---------------------
    @property
    def lora(self) -> LoraConfig | None:
        """The adapters' settings, or None when every weight trains."""
        return None

    @property
    def has_adapters(self) -> bool:
        """Whether only low-rank adapters train on top of frozen base weights."""
        return self.lora is not None

    def adapters_disabled(self) -> AbstractContextManager[None]:
        """A context in which the engine computes with its adapters off: the frozen base model.

        This is the reference policy of a LoRA run, without a second copy of the weights.
        Raises RuntimeError for an engine without adapters.
        """
        raise RuntimeError(f"{type(self).__name__} has no adapters to disable (it was built without lora.rank > 0)")

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages the model is split over, each rank holding one (1: the whole model on every rank)."""
        return 1

    @abstractmethod
    def hf_config(self) -> Any:
        """The Hugging Face config of the model (written with checkpoints, used by exports)."""

    # What checkpoints (hybridflow/engine/checkpoint.py, torch.distributed.checkpoint) read and restore:
    # any engine whose module holds plain tensors or DTensors (FSDP2, tensor parallel) works there.
    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The (sharded) model being run, under the names its checkpoints use."""

    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer, or None for an inference-only engine."""

    @property
    @abstractmethod
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The LR schedule, or None for an inference-only engine."""

    @abstractmethod
    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Save sharded model + optimizer + LR schedule + `extra` (per rank) to `path`, atomically."""

    @abstractmethod
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save_checkpoint`; return this rank's `extra`."""
