"""StatefulDataLoader: seeded batches of prompts whose position survives a restart.

Each epoch visits the dataset in the order `permutation(seed, epoch)` (or in
file order when `shuffle=False`), cut into batches of `batch_size` prompts;
an incomplete last batch is dropped (`drop_last=True`, for training) or
yielded (`drop_last=False`, for validation). `state_dict()` records the epoch and
how many batches of it were handed out; a loader given that state by
`load_state_dict()` yields exactly the batches an uninterrupted run would
have yielded next.

One `for batch in loader` pass runs the rest of the current epoch, like a
torch DataLoader, so a trainer writes `for epoch in range(loader.epoch, E):
for batch in loader: ...`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np


class StatefulDataLoader:
    """Iterates a map-style dataset in seeded, resumable batches."""

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = True,
    ):
        """`collate_fn` turns a list of items into a batch (default: the list itself)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} rows, fewer than one batch of "
                f"{batch_size}; lower data.train_batch_size or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.collate_fn = collate_fn or (lambda items: items)
        self.epoch = 0
        """The epoch the next batch comes from."""
        self.batch_in_epoch = 0
        """How many batches of `epoch` were already handed out."""

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[Any]:
        order = self.epoch_order(self.epoch)
        while self.batch_in_epoch < len(self):
            start = self.batch_in_epoch * self.batch_size
            # Advance first, so a checkpoint taken while this batch is in use resumes after it.
            self.batch_in_epoch += 1
            yield self.collate_fn([self.dataset[int(i)] for i in order[start : start + self.batch_size]])
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: {"epoch", "batch_in_epoch", "seed"}."""
        if self.batch_in_epoch >= len(self):
            return {"epoch": self.epoch + 1, "batch_in_epoch": 0, "seed": self.seed}
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`; the seed must match the one this loader was built with."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"loader state was saved with seed {state['seed']} but this run has "
                f"data.seed={self.seed}; resume with the same seed"
            )
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
