"""The resolve stage: the user's config -> one frozen run with every derived value filled in.

    cfg = load_config(RunConfig, yaml, overrides)   # user values (None = derive), checked at load
    measured = measure(cfg)                         # this machine (config/measure.py): the only I/O
    run = resolve(cfg, steps_per_epoch, measured)   # every derived value, computed once, then frozen

Derived here and nowhere else, always from the final merged values:
- trainer.n_workers_per_node=null -> the workers x threads split of the node the planner predicts fastest
  (one per GPU on cuda), then trainer.placement=auto -> colocate or split likewise (config/layout.py);
- trainer.default_local_dir / log_dir from project_name and experiment_name;
- trainer.cpus_per_worker (CPUs and torch threads per worker) from the machine and workers per node;
- trainer.call_timeout_s / collective_timeout_s from the device, trainer.max_restarts from the backend,
  trainer.max_staleness from trainer.mode;
- trainer.total_training_steps / total_epochs from each other and the steps per epoch, and the
  LR-schedule length of every optimizer (actor.optim / critic.optim .total_training_steps);
- rollout.prompt_length / response_length from data.max_prompt_length / max_response_length;
- rollout.calculate_log_probs (null) and rollout.weight_fingerprints (off with trainer.parity=off) from
  trainer.parity and the backend (hybridflow/parity/config.py);
- critic.enable and critic.model from the estimator and the policy model;
- each trained role's engine.fsdp_size and reshard_after_forward from the device and its group size,
  and its engine.tensor_parallel_size / ulysses_sequence_parallel_size (and the reward model's) checked
  against its group size and its model's heads, each pipeline_model_parallel_size against its layers;
- every compute dtype left "auto" (actor/critic engine.param_dtype, rollout.dtype, ref and reward
  model param_dtype): bf16 or fp32 as a matmul probe on trainer.cpus_per_worker threads measured
  (`Measurements.auto_dtypes`), bf16 on CUDA;
- actor.old_log_prob=auto -> rollout where the auto rule would recompute old log-probs only because the
  update takes several optimizer steps and the rollout's log-probs are the trainer's numbers
  (config/plan_inputs.py `old_log_prob_mode`);
- the worker sets (which roles live on which pool, how many ranks) and whether old log-probs
  are recomputed before the update.
A user value is never overwritten: where it contradicts a derived one, `ConfigError` names both keys.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch

from hybridflow.config.layout import choose_layout
from hybridflow.config.measure import Measurements
from hybridflow.config.plan_inputs import old_log_prob_mode, recompute_old_log_prob
from hybridflow.config.run import RunConfig
from hybridflow.config.trainer import MODE_STALENESS, JobConfig, TrainerConfig
from hybridflow.engine.config import EngineConfig, OptimConfig
from hybridflow.engine.parallel.pipeline_stage import check_pp_layout
from hybridflow.engine.parallel.sequence_parallel import check_sp_layout
from hybridflow.engine.parallel.tensor_parallel import check_tp_layout
from hybridflow.models.loading import load_config
from hybridflow.parity.config import parity_rollout_fields
from hybridflow.utils.config_loader import ConfigError, freeze, to_yaml

POLICY_ROLES = ("actor", "rollout", "ref")
"""Roles hosted by ActorRolloutRefWorker."""

DEVICE_TIMEOUTS_S = {"cpu": (1800.0, 600.0), "cuda": (3600.0, 1800.0)}
"""trainer.device -> (call_timeout_s, collective_timeout_s) where the config leaves them null.
CPU runs small models (SmolLM2's slowest call takes ~30 s on 2 cores); GPU runs bigger ones, with
long generations and checkpoints of many GB; see the TrainerConfig fields."""

DEFAULT_MAX_RESTARTS = 3
"""trainer.max_restarts on the Ray backend where the config leaves it null."""


@dataclass(frozen=True)
class WorkerSet:
    """Worker processes on one resource pool and the roles each of them hosts."""

    pool: int
    """Index of the resource pool (placement) the set lives on."""
    world_size: int
    """Processes (ranks) in the set; every role of the set runs SPMD on all of them."""
    roles: tuple[str, ...]
    """Roles hosted in every process: actor, rollout, ref, critic, reward_model, teacher, judge."""


@dataclass(frozen=True)
class ResolvedRun:
    """A run with nothing left to derive: what the trainer, the CLI and `--print-config` read."""

    config: RunConfig
    """The config with every derived value filled in; frozen (assigning a field raises)."""
    steps_per_epoch: int
    """Training steps in one pass over the (filtered) training prompts."""
    worker_sets: tuple[WorkerSet, ...]
    """Where the roles live; one worker group per set (with colocated roles fused)."""
    recompute_old_log_prob: bool
    """True: a separate forward computes old log-probs before the update. False: the update is one
    optimizer step on the weights that generated, so it uses its own forward's (actor.old_log_prob)."""
    notes: tuple[str, ...] = ()
    """What resolve chose for the user and why (the planner's predictions), for the log; not in the YAML."""

    @property
    def total_steps(self) -> int:
        """Training steps of the whole run."""
        return self.config.trainer.total_training_steps

    @property
    def roles(self) -> tuple[str, ...]:
        """Every role of the run."""
        return tuple(role for s in self.worker_sets for role in s.roles)

    def set_of(self, role: str) -> WorkerSet | None:
        """The worker set hosting `role`, or None when the run has no such role."""
        return next((s for s in self.worker_sets if role in s.roles), None)

    def to_yaml(self) -> str:
        """The resolved config (loadable with --config) followed by the derived plan as comments."""
        lines = [
            f"#   steps_per_epoch: {self.steps_per_epoch}",
            f"#   recompute_old_log_prob: {str(self.recompute_old_log_prob).lower()}",
        ]
        lines += [f"#   worker set on pool {s.pool}: {s.world_size} x [{', '.join(s.roles)}]" for s in self.worker_sets]
        return to_yaml(self.config) + "# resolved plan:\n" + "\n".join(lines) + "\n"


def resolve(cfg: RunConfig, steps_per_epoch: int, measured: Measurements) -> ResolvedRun:
    """Fill every derived value of `cfg` (left untouched) into a frozen copy; see the module docstring.
    What it needs of the machine comes in `measured` (config/measure.py): it measures nothing and prints
    nothing (the planner's choices come back as `notes`); the one file it reads is a model's config.json,
    where a tensor / sequence parallel size > 1 is checked against its heads."""
    if steps_per_epoch < 1:
        raise ConfigError(
            f"the training set gives {steps_per_epoch} steps per epoch at data.train_batch_size="
            f"{cfg.data.train_batch_size}; add prompts or lower the batch size"
        )
    cfg, notes = choose_layout(cfg, measured)
    sets = worker_sets(cfg)
    check_parallel_layouts(cfg, sets)
    trainer = resolve_trainer(cfg.trainer, steps_per_epoch, measured.cpu_count)
    total = trainer.total_training_steps
    device = trainer.device
    threads = trainer.cpus_per_worker
    critic = cfg.critic
    if cfg.use_critic:
        critic_world = next(s.world_size for s in sets if "critic" in s.roles)
        critic = replace(
            critic,
            enable=True,
            model=critic.model or cfg.model,
            optim=resolve_schedule(critic.optim, total, "critic."),
            engine=resolve_engine(
                critic.engine, device, critic_world, "critic.", measured.dtype(critic.engine.param_dtype, threads)
            ),
        )
    resolved = replace(
        cfg,
        trainer=trainer,
        rollout=replace(
            cfg.rollout,
            prompt_length=cfg.data.max_prompt_length,
            response_length=cfg.data.max_response_length,
            dtype=measured.dtype(cfg.rollout.dtype, threads),
            **parity_rollout_fields(cfg.rollout, cfg.trainer.parity, _needs_rollout_log_probs(cfg)),
        ),
        actor=replace(
            cfg.actor,
            optim=resolve_schedule(cfg.actor.optim, total, "actor."),
            engine=resolve_engine(
                cfg.actor.engine,
                device,
                sets[0].world_size,
                "actor.",
                measured.dtype(cfg.actor.engine.param_dtype, threads),
            ),
        ),
        critic=critic if cfg.use_critic else replace(critic, enable=False),
        ref=replace(cfg.ref, param_dtype=measured.dtype(cfg.ref.param_dtype, threads)),
        reward_model=replace(cfg.reward_model, param_dtype=measured.dtype(cfg.reward_model.param_dtype, threads)),
        distillation=_resolve_teacher_dtype(cfg, measured, threads),
        judge=replace(
            cfg.judge, rollout=replace(cfg.judge.rollout, dtype=measured.dtype(cfg.judge.rollout.dtype, threads))
        ),
    )
    actor_dp = cfg.actor.engine.dp_size(sets[0].world_size)
    old = old_log_prob_mode(resolved, actor_dp)
    if old != cfg.actor.old_log_prob:
        resolved = replace(resolved, actor=replace(resolved.actor, old_log_prob=old))
        notes = (*notes, f"actor.old_log_prob=auto -> {old}: fp32 native rollout and actor, several optimizer steps")
    return ResolvedRun(freeze(resolved), steps_per_epoch, sets, recompute_old_log_prob(resolved, actor_dp), notes)


def _resolve_teacher_dtype(cfg: RunConfig, measured: Measurements, threads: int):
    """The distillation section with the teacher's "auto" dtype decided (as the reference policy's)."""
    d = cfg.distillation
    return replace(d, teacher=replace(d.teacher, param_dtype=measured.dtype(d.teacher.param_dtype, threads)))


def _needs_rollout_log_probs(cfg: RunConfig) -> bool:
    corrects = cfg.algorithm.rollout_is_threshold is not None or cfg.actor.policy_loss.tis_imp_ratio_cap is not None
    return corrects or cfg.actor.old_log_prob == "rollout"


def worker_sets(cfg: RunConfig) -> tuple[WorkerSet, ...]:
    """colocate: one set hosting every role; split: the policy (actor + rollout) on the first half of
    the workers, the reference, critic, reward model and distillation teacher on the second; split with an off-policy
    trainer.mode: the rollout alone on the second half, every other role on the first."""
    roles = ["actor", "rollout"] + ["ref"] * cfg.use_ref + ["critic"] * cfg.use_critic
    roles += ["reward_model"] * cfg.reward_model.enable + ["teacher"] * cfg.distillation.enabled
    roles += ["judge"] * cfg.judge.enable
    world = cfg.world_size
    if cfg.trainer.placement == "colocate":
        return (WorkerSet(0, world, tuple(roles)),)
    if cfg.trainer.mode != "sync":  # the rollout alone, so it generates while the actor trains
        rollout_world = world // 2
        return (WorkerSet(0, world - rollout_world, ("actor", *roles[2:])), WorkerSet(1, rollout_world, ("rollout",)))
    first = world // 2
    return WorkerSet(0, first, ("actor", "rollout")), WorkerSet(1, world - first, tuple(roles[2:]))


def resolve_trainer(t: JobConfig, steps_per_epoch: int, cpu_count: int) -> JobConfig:
    """The trainer section with run directories, threads per worker (this node's `cpu_count` CPUs shared),
    run length and timeouts filled in (shared by every trainer: PPO, SFT). Not frozen: the caller freezes
    the whole config."""
    epochs, steps = t.total_epochs, t.total_training_steps
    if steps is None:
        epochs = epochs or 1
        steps = epochs * steps_per_epoch
    elif epochs is None:
        epochs = math.ceil(steps / steps_per_epoch)
    elif steps > epochs * steps_per_epoch:
        raise ConfigError(
            f"trainer.total_training_steps={steps} does not fit in trainer.total_epochs={epochs} "
            f"({steps_per_epoch} steps per epoch); set only one of them"
        )
    run_dir = os.path.join(t.project_name, t.experiment_name)
    call_s, collective_s = DEVICE_TIMEOUTS_S[t.device]
    rl = {}
    if isinstance(t, TrainerConfig):
        rl["max_staleness"] = MODE_STALENESS[t.mode] if t.max_staleness is None else t.max_staleness
    return replace(
        t,
        total_epochs=epochs,
        total_training_steps=steps,
        default_local_dir=t.default_local_dir or os.path.join("checkpoints", run_dir),
        log_dir=t.log_dir or os.path.join("outputs", run_dir),
        cpus_per_worker=t.cpus_per_worker or max(1, cpu_count // t.n_workers_per_node),
        call_timeout_s=t.call_timeout_s or call_s,
        collective_timeout_s=t.collective_timeout_s or collective_s,
        max_restarts=(DEFAULT_MAX_RESTARTS if t.backend == "ray" else 0) if t.max_restarts is None else t.max_restarts,
        **rl,
    )


def resolve_schedule(optim: OptimConfig, total: int, section: str) -> OptimConfig:
    """The optimizer config with its LR-schedule length: the user's, else the run's `total` steps.
    `section`: the key path in front of `optim.` in messages ("actor.", "critic.", "" for SFT)."""
    if optim.total_training_steps is not None and optim.total_training_steps < 1:
        raise ConfigError(
            f"{section}optim.total_training_steps must be >= 1 or null (the run's "
            f"{total} steps), got {optim.total_training_steps}"
        )
    return replace(optim, total_training_steps=optim.total_training_steps or total)


def resolve_engine(engine: EngineConfig, device: str, world: int, section: str, param_dtype: str) -> EngineConfig:
    """The engine config with fsdp_size and reshard_after_forward fixed for `device` and `world` ranks, and
    `param_dtype` (its own, with "auto" resolved: `Measurements.dtype`). `section`: the key path in front of `engine.` in messages
    ("actor.", "critic.", "" for SFT)."""

    try:
        fsdp_size = engine.resolve_fsdp_size(torch.device(device), world)
    except ValueError as err:
        raise ConfigError(
            f"{section}{err} of its worker set (trainer.n_workers_per_node * trainer.nnodes, "
            "halved with trainer.placement=split)"
        ) from None
    return replace(
        engine,
        fsdp_size=fsdp_size,
        reshard_after_forward=engine.resolve_reshard_after_forward(torch.device(device), fsdp_size),
        param_dtype=param_dtype,
    )


def check_parallel_layouts(cfg: RunConfig, sets: tuple[WorkerSet, ...]) -> None:
    """Refuse a tensor_parallel_size / ulysses_sequence_parallel_size that does not divide a worker set hosting
    the role (the reference shares the actor's) or does not fit its model's attention / kv heads; reads the
    model's config only when a size is > 1."""

    engine = cfg.actor.engine
    if cfg.actor.lora.enabled and engine.tensor_parallel_size > 1:
        raise ConfigError(
            "actor.engine.tensor_parallel_size > 1 does not combine with actor.lora.rank > 0 "
            "(peft wraps the projections tensor parallel splits)"
        )
    if cfg.actor.lora.enabled and engine.pipeline_model_parallel_size > 1:
        raise ConfigError("actor.engine.pipeline_model_parallel_size > 1 does not combine with actor.lora.rank > 0")
    policy, critic_model = ("actor", "ref"), (cfg.critic.model or cfg.model).path
    checks = [
        ("actor.engine.tensor_parallel_size", engine.tensor_parallel_size, cfg.model.path, policy, check_tp_layout),
        (
            "actor.engine.ulysses_sequence_parallel_size",
            engine.ulysses_sequence_parallel_size,
            cfg.model.path,
            policy,
            functools.partial(check_sp_layout, tp=engine.tensor_parallel_size),
        ),
        (
            "rollout.tensor_model_parallel_size",
            cfg.rollout.tensor_model_parallel_size,
            cfg.model.path,
            ("rollout",),
            check_tp_layout,
        ),
    ]
    if cfg.use_critic:
        checks += [
            (
                "critic.engine.tensor_parallel_size",
                cfg.critic.engine.tensor_parallel_size,
                critic_model,
                ("critic",),
                check_tp_layout,
            ),
            (
                "critic.engine.ulysses_sequence_parallel_size",
                cfg.critic.engine.ulysses_sequence_parallel_size,
                critic_model,
                ("critic",),
                functools.partial(check_sp_layout, tp=cfg.critic.engine.tensor_parallel_size),
            ),
        ]
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        checks.append(
            (
                "reward_model.ulysses_sequence_parallel_size",
                rm.ulysses_sequence_parallel_size,
                rm.model.path,
                ("reward_model",),
                check_sp_layout,
            )
        )
    _check_stages(cfg, critic_model)
    for key, size, path, roles, check in checks:
        if size == 1:
            continue
        hf = load_config(path)
        for s in sets:
            if set(roles) & set(s.roles):
                try:
                    check(size, s.world_size, hf.num_attention_heads, hf.num_key_value_heads, key)
                except ValueError as err:
                    raise ConfigError(f"{err} (model {path})") from None


def _check_stages(cfg: RunConfig, critic_model: str) -> None:
    """Refuse a pipeline that does not split its model's decoder layers evenly (the actor's also the reference's;
    the ranks are checked by resolve_engine)."""
    roles = [("actor", cfg.actor.engine, cfg.model.path)]
    if cfg.use_critic:
        roles.append(("critic", cfg.critic.engine, critic_model))
    for role, engine, path in roles:
        pp = engine.pipeline_model_parallel_size
        if pp > 1:
            key = f"{role}.engine.pipeline_model_parallel_size"
            try:
                check_pp_layout(pp, load_config(path).num_hidden_layers, key)
            except ValueError as err:
                raise ConfigError(f"{err} (model {path})") from None


@dataclass(frozen=True)
class StepPlan:
    """What one training step runs: decided on the controller, told to the workers (never inferred there)."""

    step: int
    """The global step (1-based)."""
    old_log_prob: bool
    """Compute old log-probs in their own pass; else the actor update uses its own forward's."""
    ref_log_prob: bool
    """Compute reference log-probs (a KL term is used)."""
    teacher_log_prob: bool
    """Compute the distillation teacher's log-probs (distillation.enabled)."""
    values: bool
    """Compute critic values (the run has a critic)."""
    update_critic: bool
    """Update the critic."""
    update_actor: bool
    """Update the actor (False during trainer.critic_warmup)."""
    validate: bool
    """Validate after this step (trainer.test_freq, and the last step)."""
    save: bool
    """Checkpoint after this step (trainer.save_freq, and the last step)."""


def plan_step(run: ResolvedRun, step: int) -> StepPlan:
    """The plan of training step `step` of `run`."""
    t, roles = run.config.trainer, run.roles
    last = step >= run.total_steps
    return StepPlan(
        step=step,
        old_log_prob=run.recompute_old_log_prob,
        ref_log_prob="ref" in roles,
        teacher_log_prob="teacher" in roles,
        values="critic" in roles,
        update_critic="critic" in roles,
        update_actor=step > t.critic_warmup,
        validate=t.test_freq > 0 and (step % t.test_freq == 0 or last),
        save=t.save_freq > 0 and (step % t.save_freq == 0 or last),
    )
