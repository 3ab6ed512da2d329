"""Role workers exposed to the controller: actor/rollout/ref, critic, reward model, distillation teacher."""

from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.config import (
    ActorConfig,
    CriticConfig,
    DistillationConfig,
    ModelConfig,
    RefConfig,
    RewardModelConfig,
    TeacherConfig,
)
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.teacher import TeacherWorker

__all__ = [
    "ActorConfig",
    "ActorRolloutRefWorker",
    "CriticConfig",
    "CriticWorker",
    "DistillationConfig",
    "ModelConfig",
    "RefConfig",
    "RewardModelConfig",
    "RewardModelWorker",
    "TeacherConfig",
    "TeacherWorker",
]
