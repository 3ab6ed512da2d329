"""Sequence generation backends: native (our KV-cache sampler), hf (transformers generate), vllm."""

from hybridflow.rollout.base import ModuleRollout, Rollout, build_rollout, eos_token_ids
from hybridflow.rollout.config import ROLLOUT_NAMES, RolloutConfig, SamplingParams, ValKwargs
from hybridflow.rollout.sync import load_state_dict_into, sync_weights

__all__ = [
    "ROLLOUT_NAMES",
    "ModuleRollout",
    "Rollout",
    "RolloutConfig",
    "SamplingParams",
    "ValKwargs",
    "build_rollout",
    "eos_token_ids",
    "load_state_dict_into",
    "sync_weights",
]
