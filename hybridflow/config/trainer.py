"""Config sections owned by the trainer: algorithm, trainer (data and reward: config/data.py).

Each section is a dataclass with a default and a docstring per field; bad
values and bad combinations fail in `__post_init__` with a message naming
the keys. Load a whole run with `hybridflow.utils.config_loader.load_config`. Batch
sizes here are global (per run), not per worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from hybridflow.algos.adv_spec import ADV_ESTIMATORS
from hybridflow.algos.kl import KL_CONTROLLERS, KL_ESTIMATORS
from hybridflow.algos.rollout_is import ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES
from hybridflow.config.data import one_of, positive
from hybridflow.parity.config import ParityFields
from hybridflow.utils.config_loader import Section
from hybridflow.utils.plugins import is_path
from hybridflow.utils.tracking import BACKENDS

DEFAULT_WORKERS_PER_NODE = 2
"""trainer.n_workers_per_node's default, and the layout search's choice where the others are predicted no
faster than its noise."""


@dataclass
class KLControlConfig(Section):
    """Controller of the KL-penalty coefficient used when algorithm.use_kl_in_reward is set."""

    type: str = "fixed"
    """"fixed" keeps kl_coef; "adaptive" moves it toward target_kl (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """Initial (or fixed) coefficient of the KL penalty."""
    target_kl: float = 0.1
    """KL the adaptive controller steers toward."""
    horizon: int = 10000
    """Adaptive controller horizon, in samples."""

    def __post_init__(self) -> None:
        one_of("algorithm.kl_ctrl.type", self.type, tuple(KL_CONTROLLERS.names()))
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {self.kl_coef}")
        if self.type == "adaptive" and (self.target_kl <= 0 or self.horizon < 1):
            raise ValueError(
                "algorithm.kl_ctrl.type=adaptive needs target_kl > 0 and horizon >= 1, "
                f"got {self.target_kl}, {self.horizon}"
            )


@dataclass
class AlgorithmConfig(Section):
    """Advantage estimation and reward shaping."""

    adv_estimator: str = "grpo"
    """Advantage estimator registered in hybridflow.algos.advantages (gae, grpo, rloo, ...)."""
    gamma: float = 1.0
    """Discount factor (GAE and REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's reward std (False is Dr. GRPO's choice)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty against the reference policy from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty: kl (k1), abs, mse (k2), low_var_kl (k3); a "+" suffix
    takes k2's gradient (hybridflow.algos.kl)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient control of the in-reward KL penalty."""
    rollout_is_threshold: float | None = None
    """Upper bound of the rollout importance weight pi_old / pi_rollout (hybridflow.algos.rollout_is);
    None: no correction and no mismatch metrics. Needs rollout.calculate_log_probs=true."""
    rollout_is_threshold_lower: float | None = None
    """Lower bound of the weight in rollout_is_mode=mask; None: 1 / rollout_is_threshold."""
    rollout_is_level: str = "token"
    """"token": one weight per token; "sequence": the product of a response's token ratios."""
    rollout_is_mode: str = "truncate"
    """"truncate": min(weight, threshold); "mask": weight 0 outside [lower, threshold]."""
    rollout_is: bool = False
    """Apply the weights to the policy loss (with rollout_is_threshold set); false: only log the
    mismatch/* metrics (verl's default)."""

    def __post_init__(self) -> None:
        ADV_ESTIMATORS.get(self.adv_estimator)  # an unknown name fails naming the key and the known ones
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"algorithm.gamma and algorithm.lam must lie in [0, 1], got {self.gamma}, {self.lam}")
        kl_name = self.kl_penalty.removesuffix("+")
        if is_path(kl_name):
            KL_ESTIMATORS.get(kl_name)  # imports a module:function path; a bad one fails naming the key
        else:
            one_of("algorithm.kl_penalty", kl_name, tuple(KL_ESTIMATORS.names()))
        self._check_rollout_is()

    def _check_rollout_is(self) -> None:
        ROLLOUT_IS_LEVELS.get(self.rollout_is_level)
        ROLLOUT_IS_MODES.get(self.rollout_is_mode)
        upper, lower = self.rollout_is_threshold, self.rollout_is_threshold_lower
        if self.rollout_is and upper is None:
            raise ValueError(
                "algorithm.rollout_is=true applies weights bounded by algorithm.rollout_is_threshold, which is "
                "unset; set the threshold (verl's default: 2.0) or algorithm.rollout_is=false"
            )
        if upper is not None and upper <= 1.0:
            raise ValueError(
                f"algorithm.rollout_is_threshold must be > 1 (it bounds pi_old / pi_rollout from "
                f"above) or null, got {upper}"
            )
        if lower is not None and (upper is None or not 0.0 <= lower < 1.0):
            raise ValueError(
                f"algorithm.rollout_is_threshold_lower={lower} needs algorithm.rollout_is_threshold "
                "and must lie in [0, 1)"
            )


@dataclass
class JobConfig(Section):
    """The trainer section every training command shares (`hybridflow sft` and `hybridflow dpo` use it as it is):
    run length, checkpoints, logging, where the workers go, timeouts and restarts."""

    project_name: str = "hybridflow"
    """Project name for loggers (wandb project, mlflow experiment)."""
    experiment_name: str = "run"
    """Name of this run for loggers and the checkpoint directory."""
    total_epochs: int | None = None
    """Passes over the training prompts; None: 1, or as many as total_training_steps needs."""
    total_training_steps: int | None = None
    """Stop after this many steps; None: total_epochs * steps per epoch. With both set, the
    steps must fit in the epochs."""
    n_workers_per_node: int | None = DEFAULT_WORKERS_PER_NODE
    """Worker processes per node (verl: n_gpus_per_node); one per device on GPU machines. null: chosen at
    load (the RL trainer only): on CPU the split of this node's cores into workers x threads that the cost
    model predicts fastest from device profiles measured once (config/measure.py, planner/auto.py; logged
    and cached), the default 2 kept unless another is predicted clearly faster (config/layout.py
    SEARCH_TIE); on CUDA one worker per visible GPU."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""
    cpus_per_worker: int | None = None
    """CPUs (and torch threads) per worker; None: this machine's CPU count // n_workers_per_node, at least 1.
    On a 2-core laptop, 1 worker x 2 threads does no gloo traffic; 2 workers x 1 thread split the batch."""
    test_freq: int = -1
    """Validate every this many steps; -1: never during training."""
    save_freq: int = -1
    """Checkpoint every this many steps and at the last step; -1: never. A recovery (max_restarts) redoes the
    steps since the newest checkpoint (from step 0 without one): pick N so N steps take a few minutes, e.g. 5
    for the main job (~2 min, 1.6 GB per checkpoint of SmolLM2 with optimizer; max_ckpt_to_keep=1 bounds disk)."""
    max_ckpt_to_keep: int | None = None
    """Keep only the newest this many checkpoints; None keeps all."""
    resume_mode: str = "auto"
    """"auto": resume from the latest checkpoint in default_local_dir if any; "disable"; "resume_path"."""
    resume_from_path: str | None = None
    """Checkpoint directory to resume from when resume_mode is "resume_path"."""
    default_local_dir: str | None = None
    """Where checkpoints are written; None: checkpoints/<project_name>/<experiment_name>."""
    log_dir: str | None = None
    """Where metrics.jsonl, TensorBoard events and the run plot go; None: outputs/<project_name>/<experiment_name>."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks: any of console, jsonl, tensorboard, wandb, mlflow."""
    val_before_train: bool = True
    """Run validation once before the first step."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (nccl): every worker computes there (hybridflow/utils/device.py); a cuda worker uses
    the GPU its Ray actor was given (index 0 of its visible devices), or LOCAL_RANK when it sees several."""
    backend: str = "ray"
    """"ray" runs workers as Ray actors; "local" runs them in-process for debugging."""
    plugins: list[str] = field(default_factory=list)
    """User code imported before the config is checked, on the controller and in every worker process before
    its models are built: importable module names or .py file paths (relative paths resolved to absolute at
    load). Their register(...) calls add policy losses, estimators, scorers, rollout/engine backends (docs/extending.md)."""
    verbose: bool = False
    """Show the workers' library progress bars and info logs (model loading, ...); off: one line per phase."""
    call_timeout_s: float | None = None
    """Longest wait for every rank of one worker call, from when it is issued (Ray backend); ranks still
    running then are killed and the run fails naming them. None: 1800 on cpu, 3600 on cuda (a hang
    surfaces, while the slowest real call -- model load, a long generate, a checkpoint -- stays far below)."""
    max_restarts: int | None = None
    """Recoveries allowed within restart_window_s (Ray backend): when a worker process dies (killed, out of
    memory, segfault) or a call or collective times out, the controller kills every worker, frees the
    placement, starts them again, reloads the newest complete checkpoint this run wrote and goes on, so the
    run's metrics are those of a run that never failed. 0: fail at once with the command that resumes.
    None: 3 on the Ray backend, 0 on the local one (its worker lives in the controller's process)."""
    restart_window_s: float = 3600.0
    """Only restarts within this many seconds count against max_restarts (a long run may recover from rare
    failures indefinitely; a worker that dies again at once exhausts them)."""
    collective_timeout_s: float | None = None
    """Longest wait of a rank in a collective for a peer (torch.distributed timeout); then gloo raises and
    NCCL aborts the rank. None: 600 on cpu, 1800 on cuda (above any rank-local phase between two
    collectives, e.g. rank 0 writing a checkpoint). Keep it below call_timeout_s: the waiting rank's
    error then reaches the controller first, with the stuck peer named as still running."""
    max_skipped_updates: int = 3
    """Stop the run, naming the steps, after this many steps in a row whose update skipped an optimizer step (a
    non-finite gradient norm: actor/update_skipped, critic/update_skipped or SFT's train/update_skipped > 0).
    0: never."""
    ray_start_timeout_s: float = 180.0
    """Longest wait for a local Ray to start (backend=ray without RAY_ADDRESS). Ray gives its node 30 s per
    attempt; on a loaded machine the start is retried until this many seconds have passed."""

    def __post_init__(self) -> None:
        # Derived values (directories, threads, run length) stay None here: hybridflow.config.resolve
        # fills them from the final merged values, after every override.
        for key, name in (
            ("trainer.project_name", self.project_name),
            ("trainer.experiment_name", self.experiment_name),
        ):
            if not name or name in (".", "..") or "/" in name or os.sep in name:
                raise ValueError(
                    f"{key} names a directory level, so it must be a non-empty name without '/', got {name!r}"
                )
        positive(
            **{
                "trainer.total_epochs": self.total_epochs,
                "trainer.cpus_per_worker": self.cpus_per_worker,
                "trainer.total_training_steps": self.total_training_steps,
                "trainer.n_workers_per_node": self.n_workers_per_node,
                "trainer.nnodes": self.nnodes,
                "trainer.max_ckpt_to_keep": self.max_ckpt_to_keep,
            }
        )
        for key, freq in (("trainer.test_freq", self.test_freq), ("trainer.save_freq", self.save_freq)):
            if freq == 0 or freq < -1:
                raise ValueError(f"{key} must be -1 (off) or >= 1, got {freq}")
        one_of("trainer.resume_mode", self.resume_mode, ("auto", "disable", "resume_path"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        for name in self.logger:
            BACKENDS.get(name)  # an unknown name fails naming trainer.logger and the known loggers
        for key, value in (
            ("trainer.call_timeout_s", self.call_timeout_s),
            ("trainer.collective_timeout_s", self.collective_timeout_s),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{key} must be > 0 seconds (null: the device's default), got {value}")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"trainer.max_restarts must be >= 0 (null: 3 on ray, 0 on local), got {self.max_restarts}")
        if self.max_skipped_updates < 0:
            raise ValueError(
                f"trainer.max_skipped_updates must be >= 0 (0: never stop), got {self.max_skipped_updates}"
            )
        if self.ray_start_timeout_s <= 0:
            raise ValueError(f"trainer.ray_start_timeout_s must be > 0 seconds, got {self.ray_start_timeout_s}")
        if self.restart_window_s <= 0:
            raise ValueError(f"trainer.restart_window_s must be > 0 seconds, got {self.restart_window_s}")
        if self.backend == "local" and self.max_restarts:
            raise ValueError(
                f"trainer.max_restarts={self.max_restarts} needs trainer.backend=ray: the local backend's "
                "worker runs inside the controller, so nothing survives to restart it; set "
                "trainer.max_restarts=0 or null"
            )
        one_of("trainer.device", self.device, ("cpu", "cuda"))
        one_of("trainer.backend", self.backend, ("ray", "local"))
        if self.device == "cuda" and not _cuda_available():
            raise ValueError("trainer.device=cuda but torch sees no CUDA device here; use trainer.device=cpu")
        if self.n_workers_per_node is None:  # chosen at resolve, which checks the result again
            return
        world = self.n_workers_per_node * self.nnodes
        if self.backend == "local" and world != 1:
            raise ValueError(
                f"trainer.backend=local runs one in-process worker; set trainer.n_workers_per_node=1 "
                f"and trainer.nnodes=1 (got {world} workers)"
            )


@dataclass
class TrainerConfig(JobConfig, ParityFields):
    """`hybridflow train`'s trainer section: the shared `JobConfig`, the parity guard (`ParityFields`) and what
    only RL runs have: validation-only runs, batch balancing, critic warm-up, placement and the off-policy modes."""

    val_only: bool = False
    """Validate the starting model once and stop: no training step, no checkpoint (verl's key)."""
    balance_batch: bool = True
    """Reorder each generated batch so every actor worker gets about the same number of tokens (the
    n samples of a prompt stay together); see hybridflow/train/balance.py."""
    critic_warmup: int = 0
    """Steps that update only the critic before the actor starts updating."""
    placement: str = "colocate"
    """"colocate": all roles share every worker; "split": actor/rollout and critic/ref get separate workers
    (with mode one_step_off/async: the rollout gets its own workers, every other role shares the rest);
    "auto": resolved at load to the runnable placement the planner predicts fastest (hybridflow/planner/auto.py,
    from trainer.device_profile; split whenever mode is one_step_off/async)."""
    device_profile: str | None = None
    """placement=auto: a `hybridflow profile` JSON for this model; None: measured at load (seconds on a tiny
    model, about a minute on SmolLM2) and cached under the model cache directory."""
    mode: str = "sync"
    """"sync": generate, then train, every step; "one_step_off": batch k+1 is generated while batch k trains
    (max_staleness 1); "async": up to max_staleness updates between the weights that generated a batch and the
    update that trains on it. The off-policy modes need placement=split (the rollout on its own workers)."""
    max_staleness: int | None = None
    """Most actor updates a sample's generating weights may lag behind the policy it trains (mode=async; 0 is
    sync's schedule). None: 0 for sync, 1 for one_step_off and async."""
    partial_rollout: bool = False
    """mode one_step_off / async (verl: async_training.partial_rollout; native and hf rollouts, not with
    rollout.agent): a weight update that lands while the rollout workers generate interrupts the generation after its
    current decode step; the rows (single-turn, or multi-turn trajectories) go on under the new weights, each token
    recording the version that sampled it (hybridflow/rollout/partial.py). The update's push then waits for one
    decode step instead of the generation."""

    def __post_init__(self) -> None:
        JobConfig.__post_init__(self)
        ParityFields.__post_init__(self)
        if self.critic_warmup < 0:
            raise ValueError(f"trainer.critic_warmup must be >= 0, got {self.critic_warmup}")
        one_of("trainer.placement", self.placement, ("colocate", "split", "auto"))
        self._check_mode()
        workers = None if self.n_workers_per_node is None else self.n_workers_per_node * self.nnodes
        if self.placement == "split" and workers is not None and workers < 2:
            raise ValueError(
                "trainer.placement=split needs at least 2 workers (trainer.n_workers_per_node * trainer.nnodes)"
            )

    def _check_mode(self) -> None:
        one_of("trainer.mode", self.mode, TRAINER_MODES)
        s = self.max_staleness
        if s is not None and s < 0:
            raise ValueError(f"trainer.max_staleness must be >= 0 or null, got {s}")
        fixed = MODE_STALENESS[self.mode] if self.mode != "async" else None
        if s is not None and fixed is not None and s != fixed:
            raise ValueError(
                f"trainer.mode={self.mode} means trainer.max_staleness={fixed}, got {s}; "
                "use trainer.mode=async for another bound"
            )
        if self.partial_rollout and self.mode == "sync":
            raise ValueError(
                "trainer.partial_rollout=true interrupts generations running on the rollout's own workers while the "
                "actor trains; set trainer.mode=one_step_off or async (sync generates between updates)"
            )
        if self.mode != "sync" and self.device == "cuda":
            raise ValueError(
                f"trainer.mode={self.mode} moves weights between pools over gloo on CPU; the NCCL "
                "transfer for trainer.device=cuda is not written yet: use trainer.mode=sync on cuda"
            )
        if self.mode != "sync" and self.placement not in ("split", "auto"):
            raise ValueError(
                f"trainer.mode={self.mode} generates on its own workers while the actor trains; "
                "set trainer.placement=split (the rollout gets half of the workers)"
            )


TRAINER_MODES = ("sync", "one_step_off", "async")
"""trainer.mode values."""
MODE_STALENESS = {"sync": 0, "one_step_off": 1, "async": 1}
"""trainer.max_staleness of each mode where the config leaves it null (async's may be set to any bound)."""


def _cuda_available() -> bool:
    return torch.cuda.is_available()
