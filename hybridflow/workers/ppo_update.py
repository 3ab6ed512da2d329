"""The PPO update schedule shared by actor and critic: epochs -> mini-batches -> micro-batches.

A worker holds its data-parallel shard of the rollout batch. Every mini-batch is
one optimizer step; its loss is normalised by the counts of the WHOLE mini-batch
over all ranks (`GlobalNorm`, all-reduced here), so gradient accumulation over
uneven micro-batches and FSDP's averaging over ranks give exactly the global
loss (see hybridflow/algos/core.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridflow.algos.core import GlobalNorm
from hybridflow.engine.base import Engine, LossFn
from hybridflow.engine.batch import MicroBatchSize, split_micro_batches
from hybridflow.protocol import DataProto

LossBuilder = Callable[[GlobalNorm], LossFn]
"""Given the mini-batch's global counts, returns the loss function of its micro-batches."""


def global_norm(response_mask: torch.Tensor) -> GlobalNorm:
    """Token and sequence counts of this mini-batch summed over every rank of the default group."""
    counts = torch.tensor([int(response_mask.sum()), int((response_mask.sum(-1) > 0).sum())], dtype=torch.int64)
    dp_size = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
        dp_size = dist.get_world_size()
    return GlobalNorm(num_tokens=int(counts[0]), num_seqs=int(counts[1]), dp_size=dp_size)


def local_mean_factor(gn: GlobalNorm, mask: torch.Tensor, loss_agg_mode: str) -> float:
    """Turns a globally normalised micro-batch loss back into that micro-batch's own mean (for logging)."""
    if loss_agg_mode == "token-mean":
        return gn.num_tokens / (gn.dp_size * max(int(mask.sum()), 1))
    return gn.num_seqs / (gn.dp_size * max(int((mask.sum(-1) > 0).sum()), 1))


def mini_batches(data: DataProto, rows: int, shuffle: bool, seed: int) -> list[DataProto]:
    """Split this rank's shard into mini-batches of `rows` rows (optionally shuffled, seeded)."""
    if shuffle:
        gen = torch.Generator().manual_seed(seed)
        data = data.select_idxs(torch.randperm(len(data), generator=gen))
    return data.split(rows)


def run_ppo_update(
    engine: Engine,
    data: DataProto,
    mini_batch_rows: int,
    micro_batch_size: MicroBatchSize,
    epochs: int,
    loss_builder: LossBuilder,
    shuffle: bool = False,
    seed: int = 0,
    **forward_kwargs: object,
) -> dict[str, list[float]]:
    """Run `epochs` passes of optimizer steps over `data`; return every step's metrics as lists.

    `mini_batch_rows` counts rows on THIS rank; `micro_batch_size` too, or is a token budget. Every rank must
    hold the same number of rows so all ranks take the same number of steps.
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    tensors = DataProto(batch=data.batch)
    for epoch in range(epochs):
        for mini in mini_batches(tensors, mini_batch_rows, shuffle, seed + epoch):
            gn = global_norm(mini.batch["response_mask"])
            micros = split_micro_batches(dict(mini.batch.items()), micro_batch_size)
            step = engine.train_step(micros, loss_builder(gn), **forward_kwargs)
            for k, v in step.items():
                metrics[k].append(v)
    return dict(metrics)
