"""Value models (critics, reward models): a causal-LM backbone with a scalar head per token.

The backbone is transformers' `*ForTokenClassification` with one label, so a value
model saves and reloads as an ordinary HF directory. `load_value_model` reads three
kinds of checkpoint:

- a causal LM (the usual critic start: the actor's weights): the backbone takes its
  weights and the head (`score`, `classifier` in GPT-2; see `value_head`) starts small
  and random;
- a saved value model (`*ForTokenClassification`): everything is restored;
- a one-label reward model (`*ForSequenceClassification`): the backbone and the trained
  head are restored. Its head has no bias, so the token head's bias is set to 0: the
  value at a position is then exactly the score the reward model gives the sequence
  that ends there. GPT-2 names the two heads differently (`score` vs `classifier`);
  the head is then read from the checkpoint files under its own name.

A checkpoint that declares a classification architecture must hold its head with one
label (`num_labels=1`); anything else is a `ValueError`, never a silently random head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForTokenClassification, PretrainedConfig, PreTrainedModel

from hybridflow.models.loading import ModelPathError, _check_weights, load_config, resolve_model_path

TRAINED_HEAD_SUFFIXES = ("ForTokenClassification", "ForSequenceClassification")
"""Architecture-name endings of checkpoints whose scalar head is trained (restored, not initialised)."""

# (index file, single file) of the weight layouts save_pretrained writes, in transformers' order of preference.
_WEIGHT_LAYOUTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)


class ValueModel(nn.Module):
    """Wraps a one-label token-classification model; `forward` returns values [B, T] fp32."""

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Per-token values V(s_t) for every position: [B, T] float32."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        # A fresh tensor, not a view: FSDP2 warns that in-place ops on a view skip its hooks.
        return out.logits.squeeze(-1).float().clone()

    def save_pretrained(self, out_dir: str | os.PathLike, **kwargs) -> None:
        """Save as an HF directory that `load_value_model` (or transformers) reloads."""
        self.backbone.save_pretrained(out_dir, **kwargs)


def has_trained_head(config: PretrainedConfig) -> bool:
    """Whether a checkpoint's config declares a `*ForTokenClassification` / `*ForSequenceClassification` model."""
    return any(a.endswith(TRAINED_HEAD_SUFFIXES) for a in config.architectures or [])


def value_head(model: PreTrainedModel) -> tuple[str, nn.Linear]:
    """(attribute name, module) of a token-classification model's head.

    The head is the model's own `nn.Linear` child with `num_labels` outputs: `score`
    in the Llama-style families, `classifier` in GPT-2.
    """
    heads = [
        (name, mod)
        for name, mod in model.named_children()
        if isinstance(mod, nn.Linear) and mod.out_features == model.config.num_labels
    ]
    if len(heads) != 1:
        raise ValueError(
            f"{type(model).__name__}: expected one nn.Linear head with {model.config.num_labels} "
            f"output(s) among its children, found {[n for n, _ in heads]}"
        )
    return heads[0]


def load_value_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> ValueModel:
    """Load a value model from a causal-LM, value-model or reward-model checkpoint, dropout off."""
    p: Path = resolve_model_path(path)
    _check_weights(p)
    config = load_config(p)
    trained = has_trained_head(config)
    if trained and config.num_labels != 1:
        raise ValueError(
            f"model path {str(p)!r} is a {config.architectures[0]} with num_labels={config.num_labels}; "
            "a value or reward model needs exactly one label (num_labels=1)"
        )
    config.num_labels = 1
    config.classifier_dropout = 0.0
    backbone, info = AutoModelForTokenClassification.from_pretrained(
        p, config=config, dtype=dtype, output_loading_info=True
    )
    name, head = value_head(backbone)
    with torch.no_grad():
        if trained:
            _restore_head(p, name, head, info)
        else:
            _init_fresh_head(head, config)
    return ValueModel(backbone)


VALUE_HEAD_SEED = 0
"""Seed of a fresh value head's weights: every process and rank builds the same head, so a run with a
critic is reproducible and its FSDP ranks start from one model."""


def _init_fresh_head(head: nn.Linear, config: PretrainedConfig) -> None:
    """Small weights so that initial values are near 0 whatever the scale of the hidden states; drawn from
    their own generator (`VALUE_HEAD_SEED`), not torch's global one."""
    std = getattr(config, "initializer_range", 0.02)
    weight = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(VALUE_HEAD_SEED)) * std
    with torch.no_grad():
        head.weight.copy_(weight)
    if head.bias is not None:
        nn.init.zeros_(head.bias)


def _restore_head(p: Path, name: str, head: nn.Linear, info: dict) -> None:
    """Give `head` the checkpoint's trained head; a bias the checkpoint lacks becomes 0.

    transformers loads the head itself when the names agree (`score` in both heads of the
    Llama-style families); otherwise (GPT-2) the checkpoint's head is the one unexpected
    top-level `<name>.weight` of the head's shape, read here from the weight files.
    """
    missing = set(info["missing_keys"])
    if f"{name}.weight" in missing:
        weight, bias = _checkpoint_head(p, head, info["unexpected_keys"])
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.copy_(bias if bias is not None else torch.zeros_like(head.bias))
    elif head.bias is not None and f"{name}.bias" in missing:
        # A sequence-classification head has no bias. transformers 5 zeroes a missing Linear
        # bias in its init, but that is each model's _init_weights to decide: make it certain.
        head.bias.zero_()


def _checkpoint_head(p: Path, head: nn.Linear, unexpected: set[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias or None) of the checkpoint's scalar head, found among the keys the model did not take."""
    names = sorted(k[: -len(".weight")] for k in unexpected if k.count(".") == 1 and k.endswith(".weight"))
    state = _read_tensors(p, [f"{n}.{part}" for n in names for part in ("weight", "bias")])
    found = [n for n in names if tuple(state[f"{n}.weight"].shape) == tuple(head.weight.shape)]
    if len(found) != 1:
        raise ValueError(
            f"model path {str(p)!r} declares a classification model but its scalar head of shape "
            f"{tuple(head.weight.shape)} is not among the checkpoint's weights (candidates: {names})"
        )
    return state[f"{found[0]}.weight"], state.get(f"{found[0]}.bias")


def _weight_files(p: Path) -> list[Path]:
    """The files that hold the weights of the HF directory `p` (all shards of the preferred layout)."""
    for index, single in _WEIGHT_LAYOUTS:
        if (p / index).is_file():
            weight_map = json.loads((p / index).read_text())["weight_map"]
            return sorted({p / f for f in weight_map.values()})
        if (p / single).is_file():
            return [p / single]
    raise ModelPathError(f"model path {str(p)!r} has no model.safetensors or pytorch_model.bin (or their index)")


def _read_tensors(p: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors called `names` (those present) from the weight files of `p`, on CPU."""
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(p):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in names if n in f.keys()})
        else:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            out.update({n: state[n] for n in names if n in state})
    return out
