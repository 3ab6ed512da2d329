"""Reward functions and the reward manager.

- `default_compute_score(data_source, solution_str, ground_truth, extra_info=None)`:
  rule scorers by data source (arithmetic, gsm8k, countdown, math `\\boxed{}`).
- `load_custom_reward_fn(path, name)`: a user's reward function from a file.
- `RewardManager`: scores a DataProto of responses into token-level scores.
"""

from hybridflow.rewards.custom import load_custom_reward_fn
from hybridflow.rewards.registry import SCORERS, default_compute_score, register_scorer

__all__ = [
    "SCORERS",
    "default_compute_score",
    "load_custom_reward_fn",
    "register_scorer",
    "RewardManager",
    "RewardResult",
]


def __getattr__(name: str):
    # The manager imports torch and DataProto; keep `import hybridflow.rewards` light.
    if name in ("RewardManager", "RewardResult"):
        from hybridflow.rewards import manager  # noqa: PLC0415  (lazy: keeps `import hybridflow.rewards` free of torch)

        return getattr(manager, name)
    raise AttributeError(f"module 'hybridflow.rewards' has no attribute {name!r}")
