"""Weight transfer between processes: the actor's gathered weights -> rollout workers in another pool.

With trainer.mode one_step_off / async the rollout lives in its own worker group, so the
in-process copy of hybridflow/rollout/sync.py cannot reach it. A `WeightBridge` is a
torch.distributed process group of its own (gloo) that spans the two pools: bridge rank 0
is the actor's rank 0, bridge rank 1 + r is rollout rank r. It is built directly on a
TCPStore rather than through `init_process_group`, because every worker already belongs
to the default group of its own pool. After each update the actor ranks gather the full
weights (a collective of the actor pool), actor rank 0 broadcasts them as one flat tensor
per dtype, and every rollout rank copies them into its generating model. With rollout.weight_fingerprints
the sender's fingerprints of the weights follow them, and each rollout rank checks what it holds after the load.

With trainer.partial_rollout the sender first announces the push in the bridge's store (`announce`), so that a
rollout rank in the middle of a generation can see it (`PushWatch`, rollout/partial.py), stop its decoding and
receive the weights right away instead of after the generation.

The receivers learn names, shapes and dtypes once, from a manifest the controller passes
along when the bridge is formed; only tensors travel afterwards.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

Manifest = list[tuple[str, tuple[int, ...], str]]
"""(name, shape, dtype name) of every weight, in the order the actor sends them."""


def manifest_of(state: dict[str, Tensor]) -> Manifest:
    """The manifest of a state dict."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


def open_store(host: str, world: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Bridge rank 0's rendezvous store on a free port of `host`; returns (store, port)."""
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, store.port


class WeightBridge:
    """One side of the bridge group (see the module docstring)."""

    def __init__(
        self, host: str, port: int, rank: int, world: int, timeout_s: float, store: dist.TCPStore | None = None
    ) -> None:
        """Join the group (blocks until all `world` ranks joined). Rank 0 passes the store it opened."""
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        self._store = store  # rank 0 serves the rendezvous: keep it alive as long as the group
        self.rank, self.world = rank, world
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("weight_bridge", store), rank, world, timeout)

    def announce(self, step: int) -> None:
        """Bridge rank 0: say in the store that the weights of `step` are about to be sent (read by `announced`)."""
        self._store.set(ANNOUNCED_KEY, str(step))

    def announced(self) -> int | None:
        """The step of the last announced push (None: none yet); never blocks."""
        return announced(self._store)

    def _broadcast(self, flat: Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.group.broadcast([flat], opts).wait()

    def send(self, state: dict[str, Tensor]) -> int:
        """Bridge rank 0: broadcast `state` (in manifest order), one flat tensor per dtype; returns bytes sent."""
        sent = 0
        for dtype in _dtypes(manifest_of(state)):
            parts = [t.detach().reshape(-1) for t in state.values() if str(t.dtype).removeprefix("torch.") == dtype]
            flat = torch.cat(parts)
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def send_prints(self, prints: list[int]) -> None:
        """Bridge rank 0: broadcast the fingerprints of the weights sent (hybridflow/parity/weights.py), in
        manifest order."""
        self._broadcast(torch.tensor(prints, dtype=torch.int64))

    def receive_prints(self, count: int) -> list[int]:
        """Other ranks: the `count` fingerprints rank 0 sent with `send_prints`."""
        flat = torch.empty(count, dtype=torch.int64)
        self._broadcast(flat)
        return flat.tolist()

    def receive(self, manifest: Manifest) -> dict[str, Tensor]:
        """Other ranks: the state dict rank 0 sent, as views into the received flat tensors."""
        state: dict[str, Tensor] = {}
        for dtype in _dtypes(manifest):
            entries = [(name, shape) for name, shape, d in manifest if d == dtype]
            flat = torch.empty(sum(math.prod(shape) for _, shape in entries), dtype=getattr(torch, dtype))
            self._broadcast(flat)
            offset = 0
            for name, shape in entries:
                n = math.prod(shape)
                state[name] = flat[offset : offset + n].view(shape)
                offset += n
        return {name: state[name] for name, _, _ in manifest}


ANNOUNCED_KEY = "weight_bridge_announced"
"""The store key holding the step of the last push the sender announced."""


def announced(store: dist.Store) -> int | None:
    """The step of the last push announced in the bridge's `store` (None: none yet); never blocks."""
    return int(store.get(ANNOUNCED_KEY)) if store.check([ANNOUNCED_KEY]) else None


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the bridge's rendezvous store (its own connection, for a thread that polls `announced`)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _dtypes(manifest: Manifest) -> list[str]:
    """The manifest's dtypes in first-seen order (both sides derive the same order)."""
    return list(dict.fromkeys(d for _, _, d in manifest))
