"""`PPOTrainer`: the control flow of PPO / GRPO and relatives, run on the controller.

`fit` reads like a single-process script: every step below is one call on a
worker group (split over the workers, run SPMD, collected) or a small function
over tensors on the controller. Which workers exist and where they live is decided
once when the run is resolved (hybridflow/config/resolve.py); what each step runs is
its `StepPlan`; which estimator and losses run is decided by name in config. Each step's
generated batch comes from `self.rollout`: generated right then (trainer.mode=sync) or ahead,
on the rollout's own workers, while earlier batches train (hybridflow/train/async_pipeline.py).
"""

from __future__ import annotations

import logging
from typing import Any

from hybridflow.config.resolve import ResolvedRun, StepPlan, plan_step
from hybridflow.parity.guard import ParityGuard
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.train import core_steps as S
from hybridflow.train.async_pipeline import AsyncRollout, RolloutSource, SyncRollout, endless
from hybridflow.train.balance import balance_batch
from hybridflow.train.checkpointing import TrainerCheckpointer
from hybridflow.train.judge_step import judge_rewards
from hybridflow.train.metrics import data_metrics, throughput_metrics, worker_metrics
from hybridflow.train.recovery import Recovery
from hybridflow.train.roles import Roles
from hybridflow.train.skip_guard import SkipGuard, SkippedUpdatesError
from hybridflow.train.validation import validate
from hybridflow.utils.progress import TrainProgress, phase
from hybridflow.utils.timing import timer
from hybridflow.utils.tracking import Tracking

log = logging.getLogger(__name__)

GEN_INPUT_KEYS = [K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS]


def _resolve(x: Any) -> DataProto:
    """A worker group's result: as is, or the value of a non-blocking call's future."""
    return x if isinstance(x, DataProto) else x.get()


def _take_metrics(data: DataProto, sink: list[DataProto]) -> DataProto:
    """Move a worker output's meta_info["metrics"] aside (so outputs can be unioned); return the data."""
    sink.append(DataProto(meta_info={K.META_METRICS: data.meta_info.pop(K.META_METRICS, {})}))
    return data


def _rollout_log_probs(batch: DataProto, backend: str) -> Any:
    """The rollout's log-probs of the sampled tokens, as actor.old_log_prob=rollout takes them for old log-probs."""
    if K.ROLLOUT_LOG_PROBS not in batch.batch.keys():
        raise ValueError(
            f"actor.old_log_prob=rollout takes the rollout's log-probs as old log-probs, but rollout.name={backend} "
            "returned none; set actor.old_log_prob=auto, or use a rollout that returns them"
        )
    return batch.batch[K.ROLLOUT_LOG_PROBS]


class PPOTrainer:
    """Runs the training loop over already-built worker groups."""

    def __init__(
        self, run: ResolvedRun, roles: Roles, inputs: Any, tracker: Tracking, recovery: Recovery | None = None
    ):
        """`inputs`: tokenizer, train_loader, val_loader and reward_fn (hybridflow.cli.train.RunInputs);
        `recovery`: the run's restart state, told of every checkpoint written, its counters logged every step."""
        self.run, self.cfg, self.roles = run, run.config, roles
        self.train_loader, self.val_loader = inputs.train_loader, inputs.val_loader
        self.reward_fn = inputs.reward_fn
        self.tokenizer = inputs.tokenizer
        self.tracker = tracker
        self.kl_ctrl = S.make_kl_controller(self.cfg.algorithm)
        self.guard = ParityGuard.from_config(self.cfg)
        self.skips = SkipGuard(self.cfg.trainer.max_skipped_updates)
        t = self.cfg.trainer
        prompts = endless(inputs.train_loader)
        self.rollout: RolloutSource = (
            SyncRollout(roles, prompts)
            if t.mode == "sync"
            else AsyncRollout(roles, prompts, run.total_steps, t.max_staleness, partial=t.partial_rollout)
        )
        self.checkpointer = TrainerCheckpointer(self.cfg, roles, inputs.train_loader, self.rollout)
        self.global_step = 0
        self.resume_from = inputs.resume_from
        self.total_steps = run.total_steps
        # The batch is split over the actor's dp groups (its tp / sp ranks share their group's rows).
        self.actor_dp = self.cfg.actor.engine.dp_size(run.set_of("actor").world_size)
        self.last_val: dict[str, float] = {}
        self.first_val: dict[str, float] = {}
        self.recovery = recovery

    def fit(self) -> dict[str, float]:
        """Train until total steps; validate, log and checkpoint on the configured schedule."""
        t = self.cfg.trainer
        self.global_step = self.checkpointer.resume(self.kl_ctrl, self.resume_from)
        if self.recovery is not None:
            self.recovery.resumed()
        if self.resume_from is not None:
            self.tracker.rewind(self.global_step)  # steps logged after the checkpoint are redone, not repeated
        if (t.val_before_train or t.val_only) and self.global_step == 0 and not self.first_val:
            self._validate()
        if t.val_only:
            return self.last_val
        with TrainProgress(self.total_steps, initial=self.global_step) as progress:
            while self.global_step < self.total_steps:
                self.global_step += 1
                plan = plan_step(self.run, self.global_step)
                metrics = self.train_step(plan)
                stop = self.skips.check(self.global_step, metrics)
                if stop is not None:  # logged first: the metrics show what the skipped updates saw
                    self.tracker.log(metrics, step=self.global_step)
                    raise SkippedUpdatesError(stop)
                metrics.update(self._validate_and_save(plan))
                metrics.update(self.recovery.metrics() if self.recovery else {})
                self.tracker.log(metrics, step=self.global_step)
                progress.update(metrics)
        return self.last_val

    def train_step(self, plan: StepPlan) -> dict[str, float]:
        """One PPO/GRPO iteration on the next batch of prompts, as `plan` says; returns its metrics."""
        cfg, roles, timing, worker_out = self.cfg, self.roles, {}, []
        with timer("step", timing):
            # 1. generate n responses per prompt of the next batch (trainer.mode=sync: now, after the rollout
            #    copies refreshed their weights; else: generated ahead, train/async_pipeline.py)
            with timer("gen", timing):
                batch = _take_metrics(self.rollout.batch(self.global_step), worker_out)
            #    ... and spread over the actor workers so that each gets about the same number of tokens
            balance = balance_batch(batch, self.actor_dp) if cfg.trainer.balance_batch else {}
            # 2. score them: rule / custom reward (+ reward model, + judge) at the last response token
            with timer("reward", timing):
                if roles.reward_model is not None:
                    batch.union(roles.reward_model.compute_rm_score(batch))
                reward = self.reward_fn(batch)
                if roles.judge is not None:  # one call over every row (train/judge_step.py)
                    with timer("judge", timing):
                        reward, _, _ = judge_rewards(roles.judge, batch, self.tokenizer, reward, cfg.judge)
                batch.batch[K.TOKEN_LEVEL_SCORES] = reward.token_level_scores
                if S.has_baseline(cfg.algorithm):  # e.g. ReMax: the greedy response's reward (its spec's baseline)
                    prompts = self.rollout.prompts_of(batch)
                    batch.batch[K.REWARD_BASELINES] = S.reward_baselines(
                        cfg.algorithm, roles, prompts, self.reward_fn, cfg.rollout.sampling_params()
                    )
            # 3. log-probs of the policy before the update, of the reference (and distillation teacher), and values
            #    (ref, teacher and critic calls return futures: with split placement they overlap; old log-probs
            #    are skipped when the update is one optimizer step, which then uses its own)
            temp = cfg.rollout.temperature  # the policy's log-probs are those of the distribution sampled from
            with timer("old_log_prob_ref_values", timing):
                ref = roles.ref.compute_ref_log_prob(batch, temperature=temp) if plan.ref_log_prob else None
                teacher = (
                    roles.teacher.compute_teacher_log_prob(batch, temperature=temp) if plan.teacher_log_prob else None
                )
                values = roles.critic.compute_values(batch) if plan.values else None
                old = roles.actor_rollout.compute_log_prob(batch, temperature=temp) if plan.old_log_prob else None
                for part in (old, ref, teacher, values):
                    if part is not None:
                        batch.union(_take_metrics(_resolve(part), worker_out))
            # 4. the parity guard: weight-sync findings, trained ids == sampled ids, trainer vs rollout log-probs;
            #    a breach raises ParityError (trainer.parity=error) or warns (hybridflow/parity/guard.py)
            with timer("parity", timing):
                parity = self.guard.before_update(batch, self.global_step)
            if reward.dropped:  # reward.non_finite=drop; after the guard, which checks the ids as sampled
                batch.batch[K.RESPONSE_MASK][reward.dropped] = 0
            if cfg.actor.old_log_prob == "rollout":  # after the guard: the update's first step checks them instead
                batch.batch[K.OLD_LOG_PROBS] = _rollout_log_probs(batch, cfg.rollout.name)
            # 5. rewards (KL penalty if in reward), advantages by the configured estimator, the
            #    rollout-vs-trainer importance weights (algorithm.rollout_is_threshold), and the teacher's signal
            with timer("adv", timing):
                kl_metrics = S.apply_rewards(batch, cfg.algorithm, self.kl_ctrl)
                kl_metrics.update(S.apply_rollout_is(batch, cfg.algorithm))
                S.compute_advantage(batch, cfg.algorithm)
                if plan.teacher_log_prob:
                    kl_metrics.update(S.apply_distillation(batch, cfg.distillation))
            # 6. update the critic, then (after warm-up) the actor; with split placement they overlap
            #    (without old log-probs the actor's own forward measures the log-prob parity, checked here)
            with timer("update", timing):
                outs = self._update(batch, plan)
            parity.update(self.guard.after_update(outs, self.global_step))
            for out in outs:
                _take_metrics(out, worker_out)
            # 7. off-policy modes: the batch's staleness, and the new weights pushed to the rollout workers
            pipeline = self.rollout.after_update(self.global_step, batch)
        return {
            **parity,
            **kl_metrics,
            **balance,
            **worker_metrics(*worker_out),
            **reward.metrics,
            **data_metrics(batch, cfg.data.max_response_length),
            **throughput_metrics(batch, timing, cfg.world_size),
            **{f"timing_s/{k}": v for k, v in timing.items()},
            "training/global_step": self.global_step,
            **pipeline,
        }

    def _update(self, batch: DataProto, plan: StepPlan) -> list[DataProto]:
        pending = []
        if plan.update_critic:
            pending.append(self.roles.critic.update_critic(batch))
        if plan.update_actor:
            own = not plan.old_log_prob and self.cfg.actor.old_log_prob != "rollout"
            temp, ratio = self.cfg.rollout.temperature, self.guard.ratio
            distill = self.cfg.distillation if self.cfg.distillation.enabled else None
            pending.append(
                self.roles.actor_rollout.update_actor(
                    batch, temperature=temp, own_old_log_prob=own, parity_ratio=ratio, distillation=distill
                )
            )
        return [_resolve(p) for p in pending]

    def _validate_and_save(self, plan: StepPlan) -> dict[str, float]:
        metrics = self._validate() if plan.validate else {}
        if plan.save:
            with phase(f"saving checkpoint global_step_{plan.step} in {self.checkpointer.root}"):
                saved = self.checkpointer.save(plan.step, self.kl_ctrl)
            if self.recovery is not None:
                self.recovery.saved.append(saved)
        return metrics

    def _validate(self) -> dict[str, float]:
        with phase(f"validating ({len(self.val_loader.dataset)} prompts)"):
            metrics = validate(
                self.roles.rollout or self.roles.actor_rollout,
                self.val_loader,
                self.reward_fn,
                self.cfg.rollout.val_kwargs.n,
            )
        self.first_val = self.first_val or metrics
        self.last_val = metrics
        if self.global_step == 0:
            self.tracker.log(metrics, step=0)
        return metrics
