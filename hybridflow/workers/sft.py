"""`SFTWorker`: supervised fine-tuning of one model over the `Engine` interface.

Every training call is one optimizer step over this rank's shard, in micro-batches.
The loss is the negative log-likelihood of the response tokens, summed and divided by
the response-token count of the WHOLE step over all ranks (`GlobalNorm`, as in the PPO
update), times the data-parallel size the engine averages gradients over. So the
loss and the gradients are the same for any number of ranks and any micro-batching:
exactly the token-mean NLL of the global batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.algos.core import GlobalNorm
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.engine.base import Engine, LossFn, MicroBatch
from hybridflow.engine.checkpoint import export_hf
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.models import resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.utils.plugins import import_plugins
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.engines import build_engine
from hybridflow.workers.ppo_update import global_norm


def nll_loss_fn(gn: GlobalNorm) -> LossFn:
    """Response-token NLL, normalised by the global token count (see module docstring)."""

    def loss_fn(outputs: dict[str, torch.Tensor], micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro[K.RESPONSE_MASK].float()
        nll_sum = -(outputs["log_probs"] * mask).sum()
        return nll_sum * gn.dp_size / max(gn.num_tokens, 1), {}

    return loss_fn


def _all_reduce_sum(values: list[float]) -> list[float]:
    """Sum `values` over the ranks of the default group (identity without one)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _micro_batches(data: DataProto, rows: int) -> list[dict[str, torch.Tensor]]:
    return [dict(m.batch.items()) for m in DataProto(batch=data.batch).split(rows)]


class SFTWorker(Worker):
    """One model trained on prompt/response pairs; the controller decides what runs when."""

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        optim: OptimConfig,
        micro_batch_size: int,
        lora: LoraConfig | None = None,
        plugins: Sequence[str] = (),
    ) -> None:
        """`plugins`: the run's trainer.plugins, imported here first (in the worker process)."""
        super().__init__()
        import_plugins(plugins)
        self.model_cfg, self.engine_cfg, self.optim_cfg, self.lora_cfg = model, engine, optim, lora
        self.micro_batch_size = micro_batch_size
        self.engine: Engine | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Form the process group and load the model with its optimizer into the engine."""

        self.init_process_group()
        self.engine = build_engine(
            resolve_model_path(self.model_cfg.path), self.engine_cfg, self.optim_cfg, lora=self.lora_cfg
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's rows (input_ids, attention_mask, position_ids, responses,
        response_mask), then one LR-schedule step. Returns metrics (the same on every rank):
        train/loss (token-mean NLL of the global batch), train/grad_norm, train/lr, train/tokens."""
        start = time.perf_counter()
        gn = global_norm(data.batch[K.RESPONSE_MASK])
        step = self.engine.train_step(_micro_batches(data, self.micro_batch_size), nll_loss_fn(gn))
        # Each rank's summed micro-batch losses are its share of the global mean, times dp_size.
        loss, tokens = _all_reduce_sum([step["loss"] / gn.dp_size, float(data.batch[K.ATTENTION_MASK].sum())])
        lr = self.engine.lr
        self.engine.lr_scheduler_step()
        metrics = {
            "train/loss": loss,
            "train/grad_norm": step["grad_norm"],
            "train/lr": lr,
            "train/update_skipped": step["update_skipped"],
            "train/tokens": tokens,
            "train/response_tokens": float(gn.num_tokens),
            "timing_s/train_on_worker": time.perf_counter() - start,
        }
        return DataProto(meta_info={K.META_METRICS: metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_loss(self, data: DataProto) -> DataProto:
        """Per row of this rank's shard, without grad: `nll_sum` (summed response NLL) and
        `num_tokens` (response tokens) [b]; the controller divides the totals (token mean)."""
        log_probs, _ = self.engine.compute_log_probs(data.batch, self.micro_batch_size)
        mask = data.batch[K.RESPONSE_MASK].float()
        return DataProto.from_dict({"nll_sum": -(log_probs * mask).sum(-1), "num_tokens": mask.sum(-1)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer + LR schedule under `path`/actor (what `hybridflow export` reads)."""
        self.engine.save_checkpoint(Path(path) / "actor")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote."""
        self.engine.load_checkpoint(Path(path) / "actor")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str, tokenizer_path: str | None = None) -> None:
        """Write the current weights as a Hugging Face directory (collective; rank 0 writes)."""

        export_hf(self.engine, out_dir, tokenizer_path)
