"""Sequence generation backends: native (our KV-cache sampler), hf (transformers generate), vllm; more by
registering in `ROLLOUT_BACKENDS` (rollout/backends.py)."""

from hybridflow.rollout.backends import ROLLOUT_BACKENDS, RolloutBackendSpec, RolloutBuilder, build_rollout
from hybridflow.rollout.base import ModuleRollout, Rollout, eos_token_ids, load_state_dict_into
from hybridflow.rollout.config import ROLLOUT_NAMES, RolloutConfig, SamplingParams, ValKwargs
from hybridflow.rollout.sync import sync_weights

__all__ = [
    "ROLLOUT_BACKENDS",
    "ROLLOUT_NAMES",
    "ModuleRollout",
    "Rollout",
    "RolloutBackendSpec",
    "RolloutBuilder",
    "RolloutConfig",
    "SamplingParams",
    "ValKwargs",
    "build_rollout",
    "eos_token_ids",
    "load_state_dict_into",
    "sync_weights",
]
