"""`SFTTrainer`: supervised fine-tuning driven from the controller, over one `SFTWorker` group.

Each step hands one batch of examples to the workers (split evenly over them), which
take one optimizer step on the token-mean response NLL of the whole batch. Validation
loss runs before training, every trainer.test_freq steps and at the end; checkpoints
(worker shards + loader position) every trainer.save_freq steps and at the end, with
the RL trainer's `RunCheckpointer` (hybridflow/train/checkpointing.py),
so `trainer.resume_mode=auto` continues exactly and `hybridflow export` reads them.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config.sft import ResolvedJob
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.protocol.future import pad_dataproto_to_divisor, unpad_dataproto
from hybridflow.train.checkpointing import RunCheckpointer
from hybridflow.train.metrics import worker_metrics
from hybridflow.train.recovery import Recovery
from hybridflow.train.skip_guard import SkipGuard, SkippedUpdatesError
from hybridflow.utils.progress import TrainProgress, phase
from hybridflow.utils.timing import timer
from hybridflow.utils.tracking import Tracking


class SFTTrainer:
    """Runs the SFT loop over an initialised `SFTWorker` group."""

    def __init__(
        self, run: ResolvedJob, workers: Any, inputs: Any, tracker: Tracking, recovery: Recovery | None = None
    ):
        """`inputs`: train_loader, val_loader and resume_from (hybridflow.cli.sft.SFTInputs);
        `recovery`: the run's restart state, told of every checkpoint written, its counters logged every step."""
        self.run, self.cfg, self.workers = run, run.config, workers
        self.train_loader, self.val_loader, self.tracker = inputs.train_loader, inputs.val_loader, tracker
        self.resume_from = inputs.resume_from
        self.checkpointer = RunCheckpointer(self.cfg, [workers], inputs.train_loader)
        self.global_step = 0
        self.val_history: list[float] = []
        self.recovery = recovery
        self.skips = SkipGuard(self.cfg.trainer.max_skipped_updates)

    def fit(self) -> list[float]:
        """Train for trainer.total_training_steps; returns every validation loss computed, in order."""
        t, total = self.cfg.trainer, self.run.total_steps
        # 1. continue from the latest checkpoint (workers + loader position), else validate the start
        self.global_step, _ = self.checkpointer.resume(self.resume_from)
        if self.recovery is not None:
            self.recovery.resumed()
        if self.resume_from is not None:
            self.tracker.rewind(self.global_step)  # steps logged after the checkpoint are redone, not repeated
        if t.val_before_train and self.global_step == 0 and not self.val_history:
            self.tracker.log(self.validate(), step=0)
        with TrainProgress(total, initial=self.global_step) as progress:
            while self.global_step < total:
                for batch in self.train_loader:
                    self.global_step += 1
                    last = self.global_step >= total
                    # 2. one optimizer step on the workers over the whole batch
                    metrics = self.train_step(batch)
                    stop = self.skips.check(self.global_step, metrics)
                    if stop is not None:  # logged first: the metrics show what the skipped updates saw
                        self.tracker.log(metrics, step=self.global_step)
                        raise SkippedUpdatesError(stop)
                    # 3. validation loss and checkpoint on schedule (and at the last step)
                    if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                        metrics.update(self.validate())
                    if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or last):
                        with phase(f"saving checkpoint global_step_{self.global_step} in {self.checkpointer.root}"):
                            saved = self.checkpointer.save(self.global_step)
                        if self.recovery is not None:
                            self.recovery.saved.append(saved)
                    metrics.update(self.recovery.metrics() if self.recovery else {})
                    self.tracker.log(metrics, step=self.global_step)
                    progress.update(metrics)
                    if last:
                        break
        return self.val_history

    def train_step(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step over `batch`; returns the step's metrics."""
        timing: dict[str, float] = {}
        with timer("step", timing):
            batch.meta_info[K.META_GLOBAL_STEP] = self.global_step
            out = self.workers.train_batch(batch)
        metrics = worker_metrics(out)  # identical on every rank, except the worker's own timing (averaged)
        step_s = timing["step"]
        metrics.update(
            {
                "train/tokens_per_s": metrics["train/tokens"] / step_s,
                "timing_s/step": step_s,
                "train/epoch": float(self.train_loader.epoch),
                "training/global_step": self.global_step,
            }
        )
        return metrics

    def validate(self) -> dict[str, float]:
        """Token-mean response NLL over the whole validation set: {"val/loss": ...}."""
        world = self.cfg.world_size
        nll = tokens = 0.0
        with phase(f"validating ({len(self.val_loader.dataset)} examples)"):
            for batch in self.val_loader:
                padded, pad = pad_dataproto_to_divisor(batch, world)
                out = unpad_dataproto(self.workers.eval_loss(padded), pad)
                nll += float(out.batch["nll_sum"].sum())
                tokens += float(out.batch["num_tokens"].sum())
        loss = nll / max(tokens, 1.0)
        self.val_history.append(loss)
        return {"val/loss": loss}
