"""The native rollout's turn engine: multi-turn trajectories decoded with their KV cache kept across turns, joining
and leaving one running batch (continuous batching), for the agent loop (hybridflow/agent/loop/runner.py).

Each trajectory owns a sequence ("slot") of the decoder's cache (`StaticLlamaDecoder.allocate_slots`), its tokens
from column 0 on, so a token's column is its rotary position. The engine remembers the ids whose keys and values
the slot holds. When the loop submits the trajectory's next turn (its whole context: the last one, the sampled
turn, the observation), only the ids after those held run (`extend`: the turn's stop token, the observation and the
next generation prompt); with `reuse_kv=False`, or a context that does not extend the held ids, the whole context
runs again from column 0 (the check costs one list comparison). The turns admitted together run their new ids in
one forward (`StaticLlamaDecoder.extend`, each row at its own slot and columns). Trajectories whose slots are empty when first
admitted together prefill their common first tokens once (a tools system prompt) and copy them
(`shared_prefix`'s rule: only when that skips `SHARED_PREFIX_MIN_SAVING` tokens).

`advance` admits queued turns (trajectories that hold a slot first, then new ones, at most
`rollout.max_batch_size` decoding at once), samples one token for every running trajectory, hands back the turns
that ended (a stop id, unless `rollout.ignore_eos`, or the turn's budget) and runs one fused decode step
(`step_rows`: each row at its own column) for the others. A trajectory whose turn ended waits in its slot while its
tool runs; the other rows go on decoding.

Reproducible whatever the scheduling: each trajectory draws its samples from its own generator, seeded from the
rollout's generator and its key (`sampling.row_uniforms`), so which trajectories share its steps, or when tools
return, changes none of its draws (the logits may still differ in their last bits with the batch's size, through
products of other shapes). Without KV reuse the same tokens run through the same weights: the ids are the same and
the log-probs agree to fp32 rounding (a key computed in a decode step and in a prefill round differently;
tests/test_rollout_native_turns.py).

The engine runs where the decoder's decode step is the fused C step (rollout/native/fused_step.py: fp32, or bf16
on panels; one rank); elsewhere (`engine_covers`) the native rollout keeps the round path of
`ModuleRollout.turn_generator` (one `generate_sequences` per round, re-prefilling every context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from hybridflow.agent.loop.runner import TurnOutput
from hybridflow.rollout.config import SamplingParams
from hybridflow.rollout.native.decoder import SHARED_PREFIX_MIN_SAVING, StaticLlamaDecoder
from hybridflow.rollout.sampling import row_uniforms, sample_next

_SEED_STRIDE = 0x9E3779B97F4A7C15
"""Spreads the keys' seeds apart (the golden ratio of 2^64, odd)."""


@dataclass
class _Trajectory:
    """What the engine keeps for one trajectory."""

    generator: torch.Generator
    slot: int | None = None
    held: list[int] = field(default_factory=list)
    """Ids whose keys and values are in the slot, from column 0 on."""
    todo: list[int] = field(default_factory=list)
    """The submitted context's ids still to run before the turn decodes."""
    budget: int = 0
    ids: list[int] = field(default_factory=list)
    """The turn's sampled ids so far."""
    log_probs: list[float] = field(default_factory=list)


class NativeTurnEngine:
    """A `TurnEngine` (hybridflow/agent/loop/runner.py) over one `StaticLlamaDecoder` (module docstring)."""

    continuous = True

    def __init__(
        self,
        decoder: StaticLlamaDecoder,
        sampling: SamplingParams,
        generator: torch.Generator,
        eos_ids: list[int] | None,
        max_rows: int,
        response_length: int,
        reuse_kv: bool = True,
    ) -> None:
        if decoder.fused is None:
            raise ValueError("the native turn engine needs the fused decode step (rollout/native/fused_step.py)")
        self.dec = decoder
        self.params = sampling
        self.eos = frozenset(eos_ids or ())  # none: rollout.ignore_eos
        self.max_rows = max_rows
        self.response_length = response_length
        self.reuse_kv = reuse_kv
        self.base_seed = int(torch.randint(2**62, (1,), generator=generator))
        self.trajs: dict[int, _Trajectory] = {}
        self.queued: list[int] = []
        self.running: list[int] = []
        self.logits: Tensor | None = None  # [len(running), V]: each running row's next-token logits
        self.free: list[int] = []
        self.slots = 0
        self.width = 0

    def submit(self, key: int, context: list[int], budget: int) -> None:
        """See `TurnEngine.submit`."""
        if budget < 1:
            raise ValueError(f"turn engine: trajectory {key} submitted with a budget of {budget} tokens (must be >= 1)")
        traj = self.trajs.get(key)
        if traj is None:
            seed = (self.base_seed + _SEED_STRIDE * (key + 1)) % 2**63
            traj = self.trajs[key] = _Trajectory(torch.Generator().manual_seed(seed))
        if not self.reuse_kv or context[: len(traj.held)] != traj.held or len(context) == len(traj.held):
            traj.held = []
        traj.todo, traj.budget, traj.ids, traj.log_probs = list(context[len(traj.held) :]), budget, [], []
        self.queued.append(key)

    def release(self, key: int) -> None:
        """See `TurnEngine.release`: its slot goes back to the free list."""
        traj = self.trajs.pop(key, None)
        if traj is not None and traj.slot is not None:
            self.free.append(traj.slot)

    @torch.inference_mode()
    def advance(self) -> list[tuple[int, TurnOutput]]:
        """See `TurnEngine.advance`: admit, sample one token per running row, step the rows still running."""
        self._admit()
        if not self.running:
            return []
        keys, logits = self.running, self.logits
        tokens, logp = self.sample(keys, logits)
        ended, going = [], []
        for i, (key, token, lp) in enumerate(zip(keys, tokens.tolist(), logp.tolist())):
            traj = self.trajs[key]
            traj.ids.append(token)
            traj.log_probs.append(lp)
            (ended if token in self.eos or len(traj.ids) >= traj.budget else going).append(i)
        done = [(keys[i], TurnOutput(self.trajs[keys[i]].ids, self.trajs[keys[i]].log_probs)) for i in ended]
        self.running = [keys[i] for i in going]
        if going:
            rows = torch.tensor(going)
            slots = torch.tensor([self.trajs[k].slot for k in self.running])
            cols = torch.tensor([len(self.trajs[k].held) for k in self.running])
            self.logits = self.dec.step_rows(tokens[rows], slots, cols)
            for key in self.running:
                self.trajs[key].held.append(self.trajs[key].ids[-1])
        else:
            self.logits = None
        return done

    def sample(self, keys: list[int], logits: Tensor) -> tuple[Tensor, Tensor]:
        """One token per running row (`keys`, in order) from its logits [B, V], each from its own generator."""
        uniforms = row_uniforms([self.trajs[k].generator for k in keys]) if self.params.do_sample else None
        return sample_next(logits, self.params, None, uniforms)

    def _admit(self) -> None:
        """Move queued turns into the running batch (slot holders first), running their new ids."""
        room = self.max_rows - len(self.running)
        if room <= 0 or not self.queued:
            return
        order = sorted(self.queued, key=lambda k: self.trajs[k].slot is None)  # stable: submission order within
        admitted, self.queued = order[:room], order[room:]
        self._reserve(admitted)
        fresh = [k for k in admitted if not self.trajs[k].held]
        self._share_prefix(fresh)
        trajs = [self.trajs[k] for k in admitted]
        logits = self.dec.extend([t.slot for t in trajs], [t.todo for t in trajs], [len(t.held) for t in trajs])
        for traj in trajs:
            traj.held, traj.todo = traj.held + traj.todo, []
        self.running = self.running + admitted
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])

    def _reserve(self, keys: list[int]) -> None:
        """A slot for each of `keys`, and room in every slot for its context and a whole response."""
        need = max(len(self.trajs[k].held) + len(self.trajs[k].todo) for k in keys) + self.response_length + 1
        lacking = [k for k in keys if self.trajs[k].slot is None]
        new_slots = max(0, len(lacking) - len(self.free))
        if new_slots or need > self.width:
            self.slots, self.width = self.slots + new_slots, max(self.width, need)
            self.free += range(self.slots - new_slots, self.slots)
            self.dec.allocate_slots(self.slots, self.width)
        for key in lacking:
            self.trajs[key].slot = self.free.pop(0)

    def _share_prefix(self, keys: list[int]) -> None:
        """Prefill the first ids that `keys`' contexts (slots empty) share once, and copy them to every slot."""
        if len(keys) < 2:
            return
        todos = [self.trajs[k].todo for k in keys]
        n = 0
        for n in range(min(map(len, todos)) - 1):  # each keeps one id of its own (its logits come from it)
            if any(t[n] != todos[0][n] for t in todos):
                break
        else:
            n = min(map(len, todos)) - 1
        if n * (len(keys) - 1) < SHARED_PREFIX_MIN_SAVING:
            return
        first, *others = (self.trajs[k] for k in keys)
        self.dec.extend([first.slot], [todos[0][:n]], [0])
        self.dec.copy_prefix(first.slot, [t.slot for t in others], n)
        for traj in (first, *others):
            traj.held, traj.todo = traj.todo[:n], traj.todo[n:]
