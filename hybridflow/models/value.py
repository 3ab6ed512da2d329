"""Value models (critics): a causal-LM backbone with a scalar head per token.

The backbone is transformers' `*ForTokenClassification` with one label, so a
value model saves and reloads as an ordinary HF directory. Built from a causal-LM
checkpoint (the usual case: the critic starts from the actor's weights), the
backbone takes that checkpoint's weights and the head `score = nn.Linear(hidden, 1)`
starts small and random; built from a saved value model, everything is restored.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForTokenClassification, PreTrainedModel

from hybridflow.models.loading import _check_weights, load_config, resolve_model_path


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
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        # A fresh tensor, not a view: FSDP2 warns that in-place ops on a view skip its hooks.
        return out.logits.squeeze(-1).float().clone()

    def save_pretrained(self, out_dir: str | os.PathLike, **kwargs) -> None:
        """Save as an HF directory that `load_value_model` (or transformers) reloads."""
        self.backbone.save_pretrained(out_dir, **kwargs)

    def activation_checkpointing_enable(self, *args, **kwargs) -> None:
        """Turn on activation checkpointing in the backbone's decoder layers."""
        self.backbone.activation_checkpointing_enable(*args, **kwargs)


def load_value_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> ValueModel:
    """Load a value model from a causal-LM checkpoint or a saved value model, dropout off."""
    p: Path = resolve_model_path(path)
    _check_weights(p)
    config = load_config(p)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    is_value_ckpt = any(a.endswith("ForTokenClassification") for a in config.architectures or [])
    backbone = AutoModelForTokenClassification.from_pretrained(p, config=config, dtype=dtype)
    if not is_value_ckpt:
        # A fresh head: small weights so initial values are near 0 whatever the scale of h.
        std = getattr(config, "initializer_range", 0.02)
        nn.init.normal_(backbone.score.weight, std=std)
        if backbone.score.bias is not None:
            nn.init.zeros_(backbone.score.bias)
    return ValueModel(backbone)
