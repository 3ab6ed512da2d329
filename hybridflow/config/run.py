"""`RunConfig`: the whole run as one nested dataclass, and the checks that span sections.

Loaded with `hybridflow.utils.config_loader.load_config(RunConfig, yaml, ["a.b=c", ...])`, it
holds the user's values only: a None means "derive it". `hybridflow.config.resolve`
computes every derived value from the final merged values and freezes the result.
Every check that spans sections runs here, at load, never inside a worker.
The defaults ARE the main job: GRPO on the bundled SmolLM2-135M-Instruct on generated
arithmetic tasks, 2 CPU workers, colocated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

from hybridflow.algos.adv_spec import AdvantageEstimatorSpec, get_advantage_spec
from hybridflow.compat.verl.dialect import VERL, VerlDialect
from hybridflow.config.data import DataConfig, RewardConfig
from hybridflow.config.trainer import AlgorithmConfig, TrainerConfig
from hybridflow.engine.config import OptimConfig
from hybridflow.rollout.backends import ROLLOUT_BACKENDS, check_backend
from hybridflow.rollout.config import RolloutConfig
from hybridflow.utils.config_loader import Section
from hybridflow.workers.config import (
    ActorConfig,
    CriticConfig,
    DistillationConfig,
    ModelConfig,
    RefConfig,
    RewardModelConfig,
)
from hybridflow.workers.engines import check_engine_backend
from hybridflow.workers.judge_config import JudgeConfig

log = logging.getLogger("hybridflow.config")


# The main job's defaults, sized so `hybridflow train` learns within ~30 minutes on 2 CPU cores:
# 8 prompts x 8 samples per step (groups of 8 keep reward variance at a ~15% base accuracy),
# two optimizer steps per training step, short answers.
def _default_data() -> DataConfig:
    return DataConfig(train_batch_size=8, max_prompt_length=128, max_response_length=32, gen_val_size=128)


def _default_actor() -> ActorConfig:
    return ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_device=16, optim=OptimConfig(lr=2e-5))


def _default_rollout() -> RolloutConfig:
    return RolloutConfig(n=8, temperature=1.0, prompt_length=None, response_length=None)


def _default_critic() -> CriticConfig:
    return CriticConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_device=16)


def _default_trainer() -> TrainerConfig:
    return TrainerConfig(total_training_steps=40, test_freq=10, logger=["console", "jsonl", "tensorboard"])


def _check_mini_batch(role: str, batch: int, mini: int) -> None:
    """verl's rule (a mini-batch fits in the batch), and hybridflow's stricter one, with the reason."""
    if mini > batch:
        raise ValueError(f"{role}.ppo_mini_batch_size ({mini}) must be <= data.train_batch_size ({batch})")
    if batch % mini:
        raise ValueError(
            f"data.train_batch_size ({batch}) must be a multiple of {role}.ppo_mini_batch_size ({mini}): hybridflow "
            "splits each step into equal mini-batches so every optimizer step averages the same number of samples "
            f"(verl would also run a last, smaller one of {batch % mini} prompts); pick a divisor of {batch}"
        )


@dataclass
class RunConfig(Section):
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (the reference and, by default, the critic start from it)."""
    data: DataConfig = field(default_factory=_default_data)
    """Prompts: files or a generated task, batch sizes, lengths."""
    actor: ActorConfig = field(default_factory=_default_actor)
    """The policy update."""
    rollout: RolloutConfig = field(default_factory=_default_rollout)
    """Generation. prompt_length/response_length default to data.max_prompt_length/max_response_length."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy (built only when a KL term is used)."""
    critic: CriticConfig = field(default_factory=_default_critic)
    """The value model (built when the estimator needs values, or critic.enable=true)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """An optional model-based reward."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rule / custom reward functions."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from a teacher's per-token log-probs (off by default)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An optional judge model (generative reward model) whose parsed verdict is the reward (off by default)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, discounting, KL in reward."""
    trainer: TrainerConfig = field(default_factory=_default_trainer)
    """Run length, checkpoints, loggers, backend and placement."""
    key_dialect: ClassVar[VerlDialect] = VERL
    """verl's key names (and, for runs written with them, verl's defaults): hybridflow/compat/verl/dialect.py."""

    @property
    def world_size(self) -> int:
        """Worker processes in the run (0 while trainer.n_workers_per_node is null: chosen at resolve)."""
        return (self.trainer.n_workers_per_node or 0) * self.trainer.nnodes

    @property
    def estimator(self) -> AdvantageEstimatorSpec:
        """The spec of algorithm.adv_estimator: what the estimator needs (critic, groups, baseline, sync mode)."""
        return get_advantage_spec(self.algorithm.adv_estimator)

    @property
    def use_critic(self) -> bool:
        """Whether a critic is built."""
        if self.critic.enable is None:
            return self.estimator.needs_critic
        return self.critic.enable

    @property
    def use_ref(self) -> bool:
        """Whether a reference policy is built."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def __post_init__(self) -> None:
        self._check_batch_sizes()
        self._check_lengths()
        self._check_algorithm()
        self._check_placement()
        self._check_reward_tokenizer()
        self._check_lora()  # before the backend checks: LoRA with vllm is refused whether vllm is installed or not
        self._check_backends()
        if self.judge.enable:
            self._check_judge()

    def _check_batch_sizes(self) -> None:
        d, a, n, w = self.data, self.actor, self.rollout.n, self.world_size
        _check_mini_batch("actor", d.train_batch_size, a.ppo_mini_batch_size)
        if self.use_critic:
            _check_mini_batch("critic", d.train_batch_size, self.critic.ppo_mini_batch_size)
        if not w:  # trainer.n_workers_per_node=null: checked again once resolve has chosen it
            return
        roles = [("actor", a.ppo_mini_batch_size, a.engine)]
        if self.use_critic:  # a run without a critic has no critic mini-batches to split
            roles.append(("critic", self.critic.ppo_mini_batch_size, self.critic.engine))
        for role, prompts, engine in roles:
            # Mini-batches split over dp groups: a tp / sp group shares its rows (a size not dividing w fails at
            # resolve).
            per = engine.ranks_per_dp_group
            groups = w // per if w % per == 0 else w
            where = (
                f"{w} workers (trainer.n_workers_per_node * trainer.nnodes)"
                if groups == w
                else f"{groups} dp groups ({w} workers / {per} {role}.engine tensor x sequence parallel ranks)"
            )
            if (prompts * n) % groups:
                raise ValueError(
                    f"{role}.ppo_mini_batch_size ({prompts}) * rollout.n ({n}) = {prompts * n} responses "
                    f"must divide evenly over {where}"
                )

    def _check_lengths(self) -> None:
        for name in ("prompt_length", "response_length"):
            mine, data = getattr(self.rollout, name), getattr(self.data, f"max_{name}")
            if mine is not None and mine != data:
                raise ValueError(
                    f"rollout.{name}={mine} conflicts with data.max_{name}={data}: the rollout's "
                    f"length is derived from the data's; set only data.max_{name}"
                )

    def _check_algorithm(self) -> None:
        est, spec = self.algorithm.adv_estimator, self.estimator
        if spec.needs_critic and self.critic.enable is False:
            raise ValueError(
                f"algorithm.adv_estimator={est} needs a critic, but critic.enable=false; "
                "enable the critic or pick a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)"
            )
        if spec.needs_groups and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator={est} compares the samples of one prompt and needs "
                f"rollout.n >= 2, got rollout.n={self.rollout.n}"
            )
        cap = self.actor.policy_loss.tis_imp_ratio_cap
        if cap is not None and self.rollout.calculate_log_probs is False:
            raise ValueError(
                f"actor.policy_loss.tis_imp_ratio_cap={cap} corrects with the rollout's own log-probs, "
                "but rollout.calculate_log_probs=false; set it to true or drop the cap"
            )
        threshold = self.algorithm.rollout_is_threshold
        if self.actor.old_log_prob == "rollout":
            self._check_old_from_rollout(cap, threshold)
        if threshold is not None and self.rollout.calculate_log_probs is False:
            if self.algorithm.rollout_is:
                raise ValueError(
                    f"algorithm.rollout_is=true weights the loss by the rollout's own log-probs (bounded by "
                    f"algorithm.rollout_is_threshold={threshold}), but rollout.calculate_log_probs=false; set it to "
                    "true or algorithm.rollout_is=false"
                )
            log.warning(  # verl's default config sets both: the threshold waits for rollout_is or the log-probs
                "algorithm.rollout_is_threshold=%s with rollout.calculate_log_probs=false: no mismatch/* metrics "
                "(they compare the rollout's own log-probs, which are not computed), as in verl",
                threshold,
            )

    def _check_old_from_rollout(self, cap: float | None, threshold: float | None) -> None:
        if self.rollout.calculate_log_probs is False:
            raise ValueError(
                "actor.old_log_prob=rollout takes the rollout's own log-probs as old log-probs, but "
                "rollout.calculate_log_probs=false; set it to true or actor.old_log_prob=auto"
            )
        if cap is not None or threshold is not None:
            key = "actor.policy_loss.tis_imp_ratio_cap" if cap is not None else "algorithm.rollout_is_threshold"
            raise ValueError(
                f"{key} corrects old log-probs towards the rollout's, but actor.old_log_prob=rollout makes them the "
                f"rollout's: there is nothing to correct; drop {key} or set actor.old_log_prob=auto"
            )

    def _check_placement(self) -> None:
        t = self.trainer
        if t.placement == "split" and t.backend == "local":
            raise ValueError("trainer.placement=split needs trainer.backend=ray")
        if t.mode != "sync" and self.estimator.sync_only:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs the training weights inside the "
                f"step (e.g. to generate its baseline), which trainer.mode={t.mode} does not support; "
                "use trainer.mode=sync"
            )
        if t.partial_rollout:
            self._check_partial_rollout()
        if (
            t.placement == "split"
            and t.mode == "sync"
            and not (self.use_critic or self.use_ref or self.distillation.enabled or self.judge.enable)
        ):
            raise ValueError(
                "trainer.placement=split puts the critic/ref/teacher/judge on their own workers, but this run has "
                "none of them; use trainer.placement=colocate"
            )

    def _check_partial_rollout(self) -> None:
        r = self.rollout
        if r.agent.enable:
            raise ValueError(
                "trainer.partial_rollout=true with rollout.agent.function: the harness's requests are not interrupted "
                "by a weight push yet; drop one of them"
            )
        if r.name not in ("native", "hf"):
            raise ValueError(
                f"trainer.partial_rollout=true with rollout.name={r.name!r}: only the native and hf rollouts stop "
                "mid-generation when a push lands; use one of them or trainer.partial_rollout=false"
            )
        if r.tensor_model_parallel_size > 1:
            raise ValueError(
                "trainer.partial_rollout=true with rollout.tensor_model_parallel_size > 1: a tensor-parallel rollout "
                "is not interrupted mid-generation yet; set one of them back"
            )

    def _check_reward_tokenizer(self) -> None:
        """verl re-templates for a reward model whose tokenizer differs from the policy's; hybridflow does not."""
        rm, policy = self.reward_model, {self.model.path, self.model.tokenizer_path} - {None}
        if rm.enable and rm.input_tokenizer is not None and rm.input_tokenizer not in policy:
            raise ValueError(
                f"reward_model.input_tokenizer={rm.input_tokenizer!r} (verl's reward_model.model.input_tokenizer) is "
                f"not the policy's tokenizer ({' / '.join(sorted(policy))}): verl would decode each response with "
                "it and re-apply the reward model's chat template, which hybridflow does not do yet (its reward "
                "model scores the policy's token ids and must share the policy's tokenizer); set it to null or to "
                "the policy's model.path"
            )

    def _check_backends(self) -> None:
        """Packages and devices the configured backends need, checked here rather than in a worker."""
        check_backend(self.rollout).check_installed(self.rollout.name, self.trainer.device)
        check_engine_backend("actor.engine", self.actor.engine)
        if self.use_critic:
            check_engine_backend("critic.engine", self.critic.engine)
        if self.reward_model.enable:
            check_engine_backend("reward_model", self.reward_model.engine_config())
        if self.distillation.enabled:
            check_engine_backend("distillation.teacher", self.distillation.teacher.engine_config())

    def _check_judge(self) -> None:
        """What the judge needs of the rest of the run (its own keys are checked by JudgeConfig)."""
        from hybridflow.rewards.judge import JUDGE_PARSERS, JUDGE_TEMPLATES  # noqa: PLC0415  (after trainer.plugins)

        JUDGE_TEMPLATES.get(self.judge.template)  # unknown names (or unloadable paths) fail naming the key
        JUDGE_PARSERS.get(self.judge.parser)
        check_backend(self.judge.rollout).check_installed(self.judge.rollout.name, self.trainer.device)
        turns = self.rollout.multi_turn.enable or self.rollout.agent.enable
        if turns:
            raise ValueError(
                "judge.enable=true with rollout.multi_turn / rollout.agent is not supported yet: the judge reads one "
                "question and one response per row; score multi-turn runs with the environment's rewards"
            )
        if self.estimator.baseline is not None:
            raise ValueError(
                f"judge.enable=true with algorithm.adv_estimator={self.algorithm.adv_estimator}, whose baseline is "
                "scored by the rule reward, not the judge, is not supported; pick grpo, rloo, gae, ..."
            )
        timeout, call = self.judge.timeout_s, self.trainer.call_timeout_s
        if call is not None and (timeout is None or timeout >= call):
            raise ValueError(
                f"judge.timeout_s={timeout} must be below trainer.call_timeout_s={call}: the call timeout kills the "
                "worker (and the policy colocated with the judge), the judge's own timeout only scores its rows"
            )

    def _check_lora(self) -> None:
        lora = self.actor.lora
        if lora.enabled and not ROLLOUT_BACKENDS.get(self.rollout.name).supports_lora_sync:
            raise ValueError(
                f"actor.lora.rank={lora.rank} with rollout.name={self.rollout.name} is not supported yet (its "
                "sync sends only the adapted layers, which this backend cannot take); use rollout.name=native "
                "or hf, or actor.lora.rank=0"
            )
