"""AdamW and the learning-rate schedules (linear warmup, then constant or cosine).

Departure from verl (verl/utils/torch_functional.py): verl's warmup factor is step / warmup_steps, so its first
update runs at lr 0; here it is (step + 1) / warmup_steps, one step ahead, and the first update is not wasted.
The warmup length is verl's: optim.lr_warmup_steps when > 0, else int(lr_warmup_steps_ratio * total steps) (verl's
documented meaning; verl's legacy FSDP workers, its default at b178a3c, read lr_warmup_steps=0 as no warmup).
"""

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
    warmup = warmup_steps(cfg)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_scheduler == "constant":
        return 1.0
    span = max(cfg.total_training_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps(cfg: OptimConfig) -> int:
    """Steps of linear warmup: lr_warmup_steps when > 0, else lr_warmup_steps_ratio * total_training_steps."""
    if cfg.lr_warmup_steps is not None and cfg.lr_warmup_steps > 0:
        return cfg.lr_warmup_steps
    return int(cfg.lr_warmup_steps_ratio * max(cfg.total_training_steps or 0, 0))


def _by_ratio(cfg: OptimConfig) -> bool:
    return (cfg.lr_warmup_steps is None or cfg.lr_warmup_steps <= 0) and cfg.lr_warmup_steps_ratio > 0


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """LambdaLR following `lr_factor`; rejects a schedule that needs an unknown run length."""
    needs_total = cfg.lr_scheduler == "cosine" or _by_ratio(cfg)
    if needs_total and (cfg.total_training_steps or 0) <= 0:
        raise ValueError(
            "optim.total_training_steps must be > 0 when optim.lr_scheduler='cosine' or the warmup is "
            f"optim.lr_warmup_steps_ratio > 0 (got {cfg.total_training_steps}); resolving a run fills it in"
        )
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
