"""Model loading: local HF directories, the bundled default model, value models."""

from hybridflow.models.default import cache_root, default_model_dir, gguf_path, tiny_model_dir
from hybridflow.models.loading import (
    ModelPathError,
    load_causal_lm,
    load_config,
    load_tokenizer,
    resolve_model_path,
)
from hybridflow.models.value import ValueModel, load_value_model

__all__ = [
    "ModelPathError",
    "ValueModel",
    "cache_root",
    "default_model_dir",
    "gguf_path",
    "load_causal_lm",
    "load_config",
    "load_tokenizer",
    "load_value_model",
    "resolve_model_path",
    "tiny_model_dir",
]
