"""`DPOWorker`: preference optimisation of one model over the `Engine` interface.

Batches hold pairs as rows 2i (chosen) and 2i+1 (rejected) (hybridflow/data/preference.py), and every split —
over ranks, into micro-batches — is even, so a pair never straddles two forwards. Each sequence's log-prob is
the sum of its response tokens' log-probs.

The reference is the initial policy: a frozen inference-only copy of the model, or with LoRA the same model
with its adapters disabled (no second copy); none with dpo.reference_free. Its log-probs are computed once per
batch, before the update. The loss is the configured preference loss (hybridflow/algos/dpo.py), summed over
pairs and divided by the pair count of the WHOLE step over all ranks, times the data-parallel size the engine
averages gradients over: the same loss and gradients for any number of ranks and any micro-batching.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hybridflow.algos.dpo import DPOLossConfig, PairLogps, dpo_loss
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.engine.base import Engine, LossFn, MicroBatch
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.models import resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.engines import build_engine
from hybridflow.workers.sft import SFTWorker, _all_reduce_sum, _micro_batches

SEQ_LOG_PROB = "seq_log_prob"
"""eval_logps output [b]: the policy's summed response log-prob of each row."""
REF_SEQ_LOG_PROB = "ref_seq_log_prob"
"""eval_logps output [b]: the reference's summed response log-prob of each row (0 when reference-free)."""
RESPONSE_TOKENS = "response_tokens"
"""eval_logps output [b]: response tokens of each row."""


def pair_logps(log_probs: torch.Tensor, ref_log_probs: torch.Tensor | None, mask: torch.Tensor) -> PairLogps:
    """Per-token log-probs [2n, R] of interleaved pairs -> their summed log-probs (module docstring)."""
    mask = mask.float()
    seq, tokens = (log_probs * mask).sum(-1), mask.sum(-1)
    ref = None if ref_log_probs is None else (ref_log_probs * mask).sum(-1)
    return PairLogps(
        seq[0::2],
        seq[1::2],
        tokens[0::2],
        tokens[1::2],
        None if ref is None else ref[0::2],
        None if ref is None else ref[1::2],
    )


class DPOWorker(SFTWorker):
    """One model trained on preference pairs, with its reference; the controller decides what runs when."""

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        optim: OptimConfig,
        micro_batch_pairs: int,
        loss: DPOLossConfig,
        lora: LoraConfig | None = None,
        plugins: Sequence[str] = (),
    ) -> None:
        """`micro_batch_pairs`: pairs per forward/backward on this worker."""
        super().__init__(model, engine, optim, 2 * micro_batch_pairs, lora, plugins)
        self.loss_cfg = loss
        self.ref: Engine | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the policy with its optimizer, and the frozen reference unless LoRA or reference-free."""
        super().init_model()
        if not self.loss_cfg.reference_free and not self.engine.has_adapters:
            # the policy's engine settings, without an optimizer: the same dtype and layout, inference only
            self.ref = build_engine(resolve_model_path(self.model_cfg.path), self.engine_cfg)

    def _reference(self, data: DataProto) -> torch.Tensor | None:
        """The reference's per-token log-probs [b, R] of this rank's rows, or None when reference-free."""
        if self.loss_cfg.reference_free:
            return None
        engine = self.ref if self.ref is not None else self.engine
        with self.engine.adapters_disabled() if self.ref is None else contextlib.nullcontext():
            log_probs, _ = engine.compute_log_probs(data.batch, self.micro_batch_size)
        return log_probs

    def _loss_fn(self, num_pairs: int, dp_size: int, collected: list) -> LossFn:
        def loss_fn(outputs: dict[str, torch.Tensor], micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            logps = pair_logps(outputs["log_probs"], micro.get(K.REF_LOG_PROB), micro[K.RESPONSE_MASK])
            loss, stats = dpo_loss(logps, self.loss_cfg, num_pairs)
            collected.append((len(logps.chosen), stats))
            return loss * dp_size, {}

        return loss_fn

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's pairs, then one LR-schedule step. Returns metrics (the same on every
        rank): train/loss, train/rewards/{chosen,rejected,margins,accuracies}, train/logps/{chosen,rejected}
        (means over the global batch), train/grad_norm, train/lr, train/tokens."""
        start = time.perf_counter()
        ref = self._reference(data)
        if ref is not None:
            data.batch[K.REF_LOG_PROB] = ref
        local_pairs = len(data) // 2
        dp_size = dist.get_world_size() if dist.is_initialized() else 1
        num_pairs, tokens = _all_reduce_sum([float(local_pairs), float(data.batch[K.ATTENTION_MASK].sum())])
        collected: list = []
        step = self.engine.train_step(
            _micro_batches(data, self.micro_batch_size), self._loss_fn(int(num_pairs), dp_size, collected)
        )
        names = sorted(collected[0][1]) if collected else []
        sums = _all_reduce_sum([step["loss"] / dp_size] + [sum(float(s[k]) * n for n, s in collected) for k in names])
        lr = self.engine.lr
        self.engine.lr_scheduler_step()
        metrics = {f"train/{k}": v / max(num_pairs, 1) for k, v in zip(names, sums[1:])}
        metrics.update(
            {
                "train/loss": sums[0],
                "train/grad_norm": step["grad_norm"],
                "train/lr": lr,
                "train/update_skipped": step["update_skipped"],
                "train/tokens": tokens,
                "timing_s/train_on_worker": time.perf_counter() - start,
            }
        )
        return DataProto(meta_info={K.META_METRICS: metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_logps(self, data: DataProto) -> DataProto:
        """Per row of this rank's shard, without grad: the policy's and the reference's summed response log-probs
        and the response token count [b] (the controller pairs rows up and computes the loss)."""
        log_probs, _ = self.engine.compute_log_probs(data.batch, self.micro_batch_size)
        ref = self._reference(data)
        mask = data.batch[K.RESPONSE_MASK].float()
        return DataProto.from_dict(
            {
                SEQ_LOG_PROB: (log_probs * mask).sum(-1),
                REF_SEQ_LOG_PROB: torch.zeros(len(data)) if ref is None else (ref * mask).sum(-1),
                RESPONSE_TOKENS: mask.sum(-1),
            }
        )
