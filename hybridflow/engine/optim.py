"""AdamW and the learning-rate schedules (linear warmup, then constant or cosine)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from hybridflow.engine.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the fused kernel.

    On CPU the fused kernel is ~4x faster than the foreach one (0.2 s vs 0.84 s for
    SmolLM2-135M on one thread, FSDP2 DTensor parameters included).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of `cfg.lr` after `step` scheduler steps.

    Warmup: (step + 1) / warmup_steps for the first warmup_steps steps (so the
    first update is not wasted at lr 0). Then 1 ("constant") or a half cosine
    from 1 down to min_lr_ratio at total_training_steps ("cosine").
    """
    warmup = int(cfg.lr_warmup_steps_ratio * max(cfg.total_training_steps or 0, 0))
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_scheduler == "constant":
        return 1.0
    span = max(cfg.total_training_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """LambdaLR following `lr_factor`; rejects a schedule that needs an unknown run length."""
    needs_total = cfg.lr_scheduler == "cosine" or cfg.lr_warmup_steps_ratio > 0
    if needs_total and (cfg.total_training_steps or 0) <= 0:
        raise ValueError(
            "optim.total_training_steps must be > 0 when optim.lr_scheduler='cosine' or "
            f"optim.lr_warmup_steps_ratio > 0 (got {cfg.total_training_steps}); resolving a run fills it in"
        )
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
