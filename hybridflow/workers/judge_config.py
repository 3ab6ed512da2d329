"""`JudgeConfig`: a judge model (generative reward model) served through a rollout backend.

verl configures its generative reward model as `reward_model.model.path` + `reward_model.rollout.*` and puts the
prompt template and the verdict parser in a custom reward function; its verl names map onto this section
(hybridflow/compat/verl/keys.py). The template and parser are plugins here (hybridflow/rewards/judge.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.rollout.config import RolloutConfig
from hybridflow.utils.config_loader import Section
from hybridflow.workers.config import ModelConfig

JUDGE_COMBINE = ("replace", "add")
"""judge.combine values."""


def _judge_rollout() -> RolloutConfig:
    return RolloutConfig(do_sample=False, n=1, prompt_length=384, response_length=8, max_batch_size=64)


@dataclass
class JudgeConfig(Section):
    """A judge model that reads each response and gives a verdict, parsed into the response's reward."""

    enable: bool = False
    """Score every response with the judge (once per step, all rows in one generate call)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The judge: a local HF causal-LM directory (or `hybridflow export` output), or "default" for the bundled
    SmolLM2-135M-Instruct. Its own tokenizer and chat template are used; it need not share the policy's."""
    rollout: RolloutConfig = field(default_factory=_judge_rollout)
    """How the judge generates (verl: reward_model.rollout): backend (native, hf, vllm where installed), dtype,
    sampling (greedy by default), prompt_length (the longest judge prompt accepted, in the judge's tokens) and
    response_length (the verdict's tokens at most)."""
    template: str = "reference_yes_no"
    """Prompt template by name or module:function path (hybridflow/rewards/judge.py JUDGE_TEMPLATES)."""
    parser: str = "yes_no"
    """Verdict parser by name or module:function path (hybridflow/rewards/judge.py JUDGE_PARSERS)."""
    invalid_score: float = 0.0
    """The judge score of a row without a verdict: an unparseable one (judge/invalid), a judge prompt over
    judge.rollout.prompt_length (judge/overlong), or a judge call that failed or timed out (judge/failed)."""
    timeout_s: float | None = 600.0
    """Seconds the judge's generate call may take inside its worker; past it every row of the call is scored
    invalid_score and counted in judge/failed, and calls wait (failing) until that generation ends. None: no
    limit."""
    combine: str = "replace"
    """"replace": the judge's score is the reward and the rule score is only logged (judge/rule_agreement);
    "add": the judge's score is added to the rule (or custom) score."""

    def __post_init__(self) -> None:
        if isinstance(self.rollout, dict):
            self.rollout = RolloutConfig(**self.rollout)
        if self.combine not in JUDGE_COMBINE:
            raise ValueError(f"judge.combine must be one of {list(JUDGE_COMBINE)}, got {self.combine!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"judge.timeout_s must be > 0 or null (no limit), got {self.timeout_s}")
        if self.enable:  # verl's generated config sets reward_model.rollout.* (judge.rollout here) for no judge
            self._check_rollout()

    def _check_rollout(self) -> None:
        r = self.rollout
        if r.n != 1:
            raise ValueError(f"judge.rollout.n must be 1 (one verdict per response), got {r.n}")
        if r.prompt_length is None or r.response_length is None:
            raise ValueError("judge.rollout.prompt_length and judge.rollout.response_length must be set (tokens)")
        if r.multi_turn.enable or r.agent.enable:
            raise ValueError(
                "judge.rollout.multi_turn / judge.rollout.agent are for the policy; the judge answers once"
            )
        if r.tensor_model_parallel_size != 1:
            raise ValueError(
                f"judge.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}: a judge split over ranks "
                "is not supported yet; set it to 1"
            )
