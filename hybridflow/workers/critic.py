"""`CriticWorker`: the value model of PPO (GAE), over the same `Engine` interface as the actor."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from hybridflow.controller.worker import Worker
from hybridflow.models import resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.utils.peak_memory import operator_peak
from hybridflow.utils.plugins import import_plugins
from hybridflow.workers.config import CriticConfig, ModelConfig
from hybridflow.workers.engines import build_engine, declare_engine_mesh
from hybridflow.workers.losses import critic_loss_builder
from hybridflow.workers.ppo_update import run_ppo_update

CRITIC_MESH = "critic"
"""The mesh the critic declares for the N-D dispatch: pp x dp x sp x tp by critic.engine's pipeline_model_parallel_size,
tensor_parallel_size and ulysses_sequence_parallel_size (collected from the last pipeline stage)."""
_ON_CRITIC_MESH = make_nd_compute_dataproto_dispatch_fn(CRITIC_MESH)


class CriticWorker(Worker):
    """Computes V(s_t) for response tokens and regresses it onto the returns.

    compute_values and update_critic are non-blocking (they return a future; call
    `.get()`), so with split placement they overlap the actor's calls.
    """

    def __init__(self, model: ModelConfig, critic: CriticConfig, rollout_n: int, plugins: Sequence[str] = ()) -> None:
        """`plugins`: the run's trainer.plugins, imported here first (in the worker process)."""
        super().__init__()
        import_plugins(plugins)
        self.model_cfg = critic.model or model
        self.cfg = critic
        self.rollout_n = rollout_n
        self.engine = None
        self._update_calls = 0
        self.dp_size = declare_engine_mesh(self, CRITIC_MESH, critic.engine, "critic.engine.")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Form the process group and load backbone + value head (head initialised from the backbone)."""

        self.init_process_group()
        path = resolve_model_path(self.model_cfg.path)
        self.engine = build_engine(path, self.cfg.engine, self.cfg.optim, value_model=True)

    @register(dispatch_mode=_ON_CRITIC_MESH, blocking=False)
    def compute_values(self, data: DataProto) -> DataProto:
        """Rows with input_ids/attention_mask/position_ids/responses -> values [b, R]."""
        metrics: dict[str, float] = {}
        with operator_peak("values", metrics):
            values = self.engine.compute_values(data.batch, self.cfg.forward_micro())
        return DataProto.from_dict({K.VALUES: values}, meta_info={K.META_METRICS: metrics})

    @register(dispatch_mode=_ON_CRITIC_MESH, blocking=False)
    def update_critic(self, data: DataProto) -> DataProto:
        """Clipped value-loss steps over mini/micro-batches; rows need values, returns, response_mask."""
        mini_rows = self.cfg.ppo_mini_batch_size * self.rollout_n // self.dp_size
        start, peak = time.perf_counter(), {}
        with operator_peak("update_critic", peak):
            step_metrics = run_ppo_update(
                self.engine,
                data,
                max(mini_rows, 1),
                self.cfg.update_micro(),
                self.cfg.ppo_epochs,
                critic_loss_builder(self.cfg),
                seed=self._update_calls,
            )
        self._update_calls += 1
        lr = self.engine.lr_scheduler_step()
        metrics = {f"critic/{k}": v for k, v in step_metrics.items() if k != "lr"}
        metrics.update({"critic/lr": lr, "timing_s/update_critic_on_worker": time.perf_counter() - start, **peak})
        return DataProto(meta_info={K.META_METRICS: metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded critic checkpoint under `path`/critic."""
        self.engine.save_checkpoint(Path(path) / "critic", extra={"update_calls": self._update_calls})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote."""
        extra = self.engine.load_checkpoint(Path(path) / "critic")
        self._update_calls = int(extra.get("update_calls", 0))
