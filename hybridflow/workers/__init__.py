"""Role workers exposed to the controller: actor/rollout/ref, critic, reward model."""

from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.config import ActorConfig, CriticConfig, ModelConfig, RefConfig, RewardModelConfig
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardModelWorker

__all__ = [
    "ActorConfig",
    "ActorRolloutRefWorker",
    "CriticConfig",
    "CriticWorker",
    "ModelConfig",
    "RefConfig",
    "RewardModelConfig",
    "RewardModelWorker",
]
