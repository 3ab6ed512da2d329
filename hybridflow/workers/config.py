"""Typed configs of the role workers: model, actor, reference, critic, reward model.

Batch sizes follow verl's convention: `ppo_mini_batch_size` counts PROMPTS for the
whole run (all data-parallel ranks together; the worker multiplies by rollout.n and
divides by its world size), `*_per_device` sizes count rows on one worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.algos.core import LOSS_AGG_MODES
from hybridflow.algos.kl import KL_ESTIMATORS
from hybridflow.algos.losses import POLICY_LOSSES, PolicyLossConfig
from hybridflow.engine.batch import MicroBatchSize, TokenBudget
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.utils.config_loader import Section
from hybridflow.utils.dtypes import check_dtype
from hybridflow.utils.registry import Registry, UnknownNameError

OLD_LOG_PROB_MODES = ("auto", "recompute", "rollout")
"""Values of actor.old_log_prob."""


def _one_of(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is unknown; valid: {list(allowed)}")


def _registered(key: str, value: str, registry: Registry) -> None:
    """Look `value` up (loading a module:function path); an unknown name fails naming `key`, not the registry's
    shared key."""
    try:
        registry.get(value)
    except UnknownNameError:
        raise ValueError(f"{key}={value!r} is unknown; valid: {registry.names()} (or a module:function path)") from None


@dataclass
class ModelConfig(Section):
    """Which model a role loads."""

    path: str = "default"
    """Local Hugging Face directory, or "default" for the bundled SmolLM2-135M-Instruct."""
    tokenizer_path: str | None = None
    """Tokenizer directory when it differs from `path`."""


@dataclass
class ActorConfig(Section):
    """The policy being trained: PPO update schedule, losses and optimizer."""

    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step, over all workers (times rollout.n responses)."""
    ppo_micro_batch_size_per_device: int = 8
    """Rows per forward/backward on one worker (gradient accumulation inside a mini-batch)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per training step."""
    shuffle: bool = False
    """Shuffle rows before splitting into mini-batches (seeded by the step)."""
    policy_loss_mode: str = "vanilla"
    """Policy loss by registry name (hybridflow.algos.list_policy_losses())."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Clip ratios and the parameters of the other policy losses."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (the loss subtracts entropy_coeff * entropy)."""
    use_kl_loss: bool = False
    """Add a KL(pi || pi_ref) loss term (GRPO style); needs the reference policy."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    log_prob_micro_batch_size_per_device: int = 16
    """Rows per forward when computing old log-probs (no grad) on one worker."""
    use_dynamic_bsz: bool = False
    """Size micro-batches by tokens instead of rows (update: ppo_max_token_len_per_gpu; old log-probs:
    log_prob_max_token_len_per_gpu), so short rows share a forward and long ones do not pile up."""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: real tokens per update micro-batch on one worker."""
    log_prob_max_token_len_per_gpu: int | None = None
    """With use_dynamic_bsz: real tokens per old-log-prob micro-batch; None: ppo_max_token_len_per_gpu."""
    old_log_prob: str = "auto"
    """"auto": when the update is a single optimizer step per batch (ppo_epochs 1, one
    mini-batch) and nothing before it needs them (no KL in the reward), old log-probs are
    the detached log-probs of the update's own forward, which runs on the same weights,
    saving one forward pass over the batch (TRL does the same with num_iterations=1);
    actor/entropy then comes from that forward. With several optimizer steps, auto resolves
    to "rollout" where the rollout's log-probs are the trainer's numbers (native rollout with
    fp32 weights and math, fp32 actor, parity guard on, sync, no adapters, tools, pipeline stages,
    KL in the reward or rollout correction; `--print-config` shows it), else recomputes. "recompute":
    always a separate pass.
    "rollout": no pass; old log-probs are the rollout's own log-probs of the sampled tokens (verl's
    rollout-correction bypass mode), which the parity guard checks against the update's first optimizer
    step, run on the weights that generated (the step fails on a breach, as with "auto"). Needs
    rollout.calculate_log_probs and no rollout-vs-trainer correction (rollout_is_threshold,
    tis_imp_ratio_cap): the two log-probs are the same numbers there."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    """AdamW and LR schedule."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """FSDP2 engine settings (dtype, remove padding, checkpointing)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (rank 0: off). With adapters the reference
    policy is the same model with its adapters disabled: no second copy of the weights."""

    def __post_init__(self) -> None:
        for key in (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_device",
            "ppo_epochs",
            "log_prob_micro_batch_size_per_device",
            "ppo_max_token_len_per_gpu",
            "log_prob_max_token_len_per_gpu",
        ):
            if (getattr(self, key) or 1) < 1:
                raise ValueError(f"actor.{key} must be >= 1, got {getattr(self, key)}")
        POLICY_LOSSES.get(self.policy_loss_mode)  # unknown names (or unloadable paths) fail naming the key
        _registered("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _one_of("actor.old_log_prob", self.old_log_prob, OLD_LOG_PROB_MODES)
        _registered("actor.kl_loss_type", self.kl_loss_type, KL_ESTIMATORS)

    def update_micro(self) -> MicroBatchSize:
        """Micro-batch size of the update: rows, or a token budget with use_dynamic_bsz."""
        return (
            TokenBudget(self.ppo_max_token_len_per_gpu)
            if self.use_dynamic_bsz
            else self.ppo_micro_batch_size_per_device
        )

    def log_prob_micro(self) -> MicroBatchSize:
        """Micro-batch size of the old-log-prob pass: rows, or a token budget with use_dynamic_bsz."""
        if not self.use_dynamic_bsz:
            return self.log_prob_micro_batch_size_per_device
        return TokenBudget(self.log_prob_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu)


@dataclass
class RefConfig(Section):
    """The frozen reference policy (for KL)."""

    log_prob_micro_batch_size_per_device: int = 16
    """Rows per forward on one worker."""
    log_prob_use_dynamic_bsz: bool = False
    """Size micro-batches by tokens (log_prob_max_token_len_per_gpu) instead of rows."""
    log_prob_max_token_len_per_gpu: int = 16384
    """With log_prob_use_dynamic_bsz: real tokens per micro-batch on one worker."""
    param_dtype: str = "auto"
    """Compute dtype of the reference forward ("fp32" | "bf16" | "auto": as engine.param_dtype). Unused
    when the reference is the actor with its LoRA adapters disabled (colocated, actor.lora.rank > 0):
    actor.engine.param_dtype."""

    def __post_init__(self) -> None:
        for key in ("log_prob_micro_batch_size_per_device", "log_prob_max_token_len_per_gpu"):
            if getattr(self, key) < 1:
                raise ValueError(f"ref.{key} must be >= 1, got {getattr(self, key)}")
        check_dtype("ref.param_dtype", self.param_dtype)

    def log_prob_micro(self) -> MicroBatchSize:
        """Micro-batch size of the reference pass: rows, or a token budget with log_prob_use_dynamic_bsz."""
        if self.log_prob_use_dynamic_bsz:
            return TokenBudget(self.log_prob_max_token_len_per_gpu)
        return self.log_prob_micro_batch_size_per_device


@dataclass
class CriticConfig(Section):
    """The value model of PPO/GAE: a causal-LM backbone with a scalar head."""

    enable: bool | None = None
    """Build a critic; None = only when the advantage estimator needs values (gae)."""
    model: ModelConfig | None = None
    """Critic model; None = initialise from the actor's model."""
    ppo_mini_batch_size: int = 8
    """Prompts per critic optimizer step, over all workers (times rollout.n)."""
    ppo_micro_batch_size_per_device: int = 8
    """Rows per forward/backward on one worker."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per training step."""
    use_dynamic_bsz: bool = False
    """Size micro-batches by tokens (ppo_max_token_len_per_gpu, forward_max_token_len_per_gpu) instead of rows."""
    ppo_max_token_len_per_gpu: int = 32768
    """With use_dynamic_bsz: real tokens per update micro-batch on one worker."""
    forward_max_token_len_per_gpu: int = 32768
    """With use_dynamic_bsz: real tokens per micro-batch of compute_values."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token value loss."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """AdamW and LR schedule of the critic."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """FSDP2 engine settings of the critic."""

    def __post_init__(self) -> None:
        for key in (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_device",
            "ppo_epochs",
            "ppo_max_token_len_per_gpu",
            "forward_max_token_len_per_gpu",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"critic.{key} must be >= 1, got {getattr(self, key)}")
        if self.cliprange_value <= 0:
            raise ValueError(f"critic.cliprange_value must be > 0, got {self.cliprange_value}")
        _registered("critic.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)

    def update_micro(self) -> MicroBatchSize:
        """Micro-batch size of the critic update: rows, or a token budget with use_dynamic_bsz."""
        return (
            TokenBudget(self.ppo_max_token_len_per_gpu)
            if self.use_dynamic_bsz
            else self.ppo_micro_batch_size_per_device
        )

    def forward_micro(self) -> MicroBatchSize:
        """Micro-batch size of compute_values: rows, or a token budget with use_dynamic_bsz."""
        return (
            TokenBudget(self.forward_max_token_len_per_gpu)
            if self.use_dynamic_bsz
            else self.ppo_micro_batch_size_per_device
        )


@dataclass
class RewardModelConfig(Section):
    """An optional model-based reward: a sequence classifier scored at the last token."""

    enable: bool = False
    """Score responses with a reward model worker (added to the rule scores)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Reward model: a local HF directory saved from a *ForSequenceClassification (or
    *ForTokenClassification) model with num_labels=1; a plain causal LM is refused."""
    micro_batch_size_per_device: int = 16
    """Rows per forward on one worker."""
    param_dtype: str = "auto"
    """Compute dtype of the reward-model forward ("fp32" | "bf16" | "auto": as engine.param_dtype)."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks each micro-batch's tokens are split over (verl's key; see EngineConfig); 1: off."""

    backend: str | None = None
    """Engine backend of the reward model (see EngineConfig.backend); None: chosen from the layout."""
    input_tokenizer: str | None = None
    """verl's reward_model.model.input_tokenizer: the tokenizer the responses are in. verl then decodes them and
    re-applies the reward model's chat template; hybridflow scores the policy's token ids as generated, so only
    null or the policy's own tokenizer (model.path / model.tokenizer_path) is accepted."""

    def engine_config(self) -> EngineConfig:
        """The inference engine's settings."""
        return EngineConfig(
            param_dtype=self.param_dtype,
            ulysses_sequence_parallel_size=self.ulysses_sequence_parallel_size,
            backend=self.backend,
        )

    def __post_init__(self) -> None:
        if self.ulysses_sequence_parallel_size < 1:
            raise ValueError(
                f"reward_model.ulysses_sequence_parallel_size must be >= 1, got {self.ulysses_sequence_parallel_size}"
            )
        if self.micro_batch_size_per_device < 1:
            raise ValueError(
                f"reward_model.micro_batch_size_per_device must be >= 1, got {self.micro_batch_size_per_device}"
            )
        check_dtype("reward_model.param_dtype", self.param_dtype)


@dataclass
class TeacherConfig(Section):
    """The frozen teacher of on-policy distillation: a forward-only causal LM scoring the student's tokens."""

    path: str | None = None
    """Local Hugging Face directory of the teacher (a `hybridflow export` output is one), or "default" for the
    bundled SmolLM2-135M-Instruct. Must use the student's tokenizer: another one is refused at load."""
    param_dtype: str = "auto"
    """Compute dtype of the teacher forward ("fp32" | "bf16" | "auto": as engine.param_dtype)."""
    log_prob_micro_batch_size_per_device: int = 16
    """Rows per teacher forward on one worker."""

    def __post_init__(self) -> None:
        if self.log_prob_micro_batch_size_per_device < 1:
            raise ValueError(
                "distillation.teacher.log_prob_micro_batch_size_per_device must be >= 1, got "
                f"{self.log_prob_micro_batch_size_per_device}"
            )
        check_dtype("distillation.teacher.param_dtype", self.param_dtype)

    def engine_config(self) -> EngineConfig:
        """The teacher's inference engine settings."""
        return EngineConfig(param_dtype=self.param_dtype)


DEFAULT_DISTILLATION_ESTIMATOR = {"advantage": "k1", "loss": "k3"}
"""distillation.kl_estimator when null, by distillation.signal (hybridflow/algos/distillation.py)."""


@dataclass
class DistillationConfig(Section):
    """On-policy distillation (hybridflow/algos/distillation.py): the teacher's log-probs of the student's sampled
    tokens give every response token a signal, as an advantage or as a loss term, with or without the rule reward."""

    enabled: bool = False
    """Build the teacher and train on its per-token reverse KL (verl: distillation.enabled)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher model (verl: distillation.teacher_models.<name>.model_path; one teacher)."""
    signal: str = "advantage"
    """"advantage": per-token advantage -coef * reverse_kl (the Tinker cookbook's formulation; verl's
    distillation_loss.use_policy_gradient=true), added to the rule reward's advantage when use_task_rewards.
    "loss": coef * reverse_kl aggregated like the policy loss (actor.loss_agg_mode) and added to it
    (use_policy_gradient=false)."""
    coef: float = 1.0
    """Scale of the distillation signal (verl: distillation_loss.distillation_loss_coef)."""
    kl_estimator: str | None = None
    """Per-token reverse-KL estimator by KL_ESTIMATORS name (k1 = log pi_s - log pi_t, k2, k3 = low_var_kl, abs;
    verl: distillation_loss.loss_mode); null: k1 for signal=advantage, k3 for signal=loss."""
    use_task_rewards: bool = True
    """Also train on the rule / reward-model reward's advantages (verl: distillation_loss.use_task_rewards); false:
    the distillation signal alone (the task advantages are zeroed)."""
    kl_clamp: float | None = None
    """Bound each token's reverse-KL estimate to [-kl_clamp, kl_clamp]; null: no bound (verl:
    distillation_loss.loss_max_clamp)."""
    log_prob_min_clamp: float | None = None
    """Bound student and teacher log-probs from below before the estimate; null: no bound (verl:
    distillation_loss.log_prob_min_clamp)."""

    @property
    def estimator(self) -> str:
        """The reverse-KL estimator in effect (kl_estimator, or the signal's default)."""
        return self.kl_estimator or DEFAULT_DISTILLATION_ESTIMATOR.get(self.signal, "k1")

    def __post_init__(self) -> None:
        _one_of("distillation.signal", self.signal, DEFAULT_DISTILLATION_ESTIMATOR)
        if self.kl_estimator is not None:
            _registered("distillation.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"distillation.kl_clamp must be > 0 or null, got {self.kl_clamp}")
        if not self.enabled:
            return
        if not self.teacher.path:
            raise ValueError(
                "distillation.enabled=true needs a teacher: set distillation.teacher.path to a local Hugging Face "
                "directory or a `hybridflow export` output (verl: distillation.teacher_models.<name>.model_path)"
            )
        if self.coef <= 0:
            raise ValueError(f"distillation.coef must be > 0 with distillation.enabled=true, got {self.coef}")
        if self.signal == "loss" and KL_ESTIMATORS.get(self.estimator) is KL_ESTIMATORS.get("k1"):
            raise ValueError(
                f"distillation.signal=loss with distillation.kl_estimator={self.estimator}: the gradient of the k1 "
                "estimate does not depend on the teacher (its mean over the student's samples is zero); use k3 "
                "(low_var_kl) or k2 for a loss, or distillation.signal=advantage for k1"
            )
