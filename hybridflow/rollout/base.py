"""The rollout interface and the shared in-process implementation (backends by name: rollout/backends.py).

Input of `generate_sequences`: a DataProto with `input_ids` [B, P] (left-padded),
`attention_mask` and `position_ids`, and the call's `SamplingParams` (None: the
configured training params, `RolloutConfig.sampling_params()`). Output: B*n rows, the n
samples of a prompt adjacent, with the keys of hybridflow/protocol/keys.py (see `layout.build_output`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.agent.loop.runner import GenerateFn, TurnEngine, TurnOutput
from hybridflow.engine.parallel.dims import Axis, GenerationDims
from hybridflow.engine.reshard import GenerationLayout
from hybridflow.models import load_causal_lm
from hybridflow.protocol import DataProto
from hybridflow.protocol.keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from hybridflow.rollout.config import RolloutConfig, SamplingParams
from hybridflow.rollout.layout import build_output
from hybridflow.utils.device import device_kind


class Rollout(ABC):
    """A sequence-generation backend: prompts in, sampled responses out."""

    @abstractmethod
    def generate_sequences(self, prompts: DataProto, sampling: SamplingParams | None = None) -> DataProto:
        """Sample `sampling.n` responses per prompt row with `sampling` (None: the configured training
        params); returns B*n rows in the layout of hybridflow/protocol/keys.py. Reads no meta_info."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, Tensor], partial: bool = False) -> None:
        """Replace the generating model's weights with a state dict (any float dtype) under HF names:
        all of them, or with `partial` any subset (the other weights are kept)."""

    @abstractmethod
    def reseed(self, step: int) -> None:
        """Seed the sampler from (config.seed, step), so a resumed run samples as an uninterrupted one.

        The worker calls it before each training step's generation; config.seed already differs per rank.
        """

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype `load_weights` stores (None: unknown); weight sync gathers in it."""
        return None

    def generation_layout(self) -> GenerationLayout | None:
        """How the rollout's weights lie over the ranks when each rank holds only a shard of them
        (then `shard_tensors` gives them); None: every rank holds every weight whole."""
        return None

    def shard_tensors(self) -> dict[str, Tensor]:
        """Name -> the tensor `load_weights` writes (this rank's shard), for resharding in place."""
        raise NotImplementedError(f"{type(self).__name__} holds whole weights; use load_weights")

    def held_weights(self) -> dict[str, Tensor] | None:
        """Name (as `load_weights` takes it) -> the tensor the rollout generates with, after the last load (this
        rank's shard where split), for the weight-sync fingerprints (hybridflow/parity/weights.py); None where
        the backend's weights cannot be read back as loaded (then the sync is not checked)."""
        return None

    def as_held(self, name: str, t: Tensor) -> Tensor:
        """The part of a sent whole tensor `t` that this rank keeps under `name` (all of it unless split)."""
        return t

    def share_weights(self, tensors: dict[str, Tensor]) -> bool:
        """Generate with `tensors` (name -> the trainer's own tensor) from now on instead of a copy, if the backend
        can; False (the default) where it cannot, and the sync copies as usual."""
        return False

    prints_own_weights = False
    """True where the weights live out of `held_weights`' reach (vllm's worker) and `held_prints` fingerprints
    them where they are."""
    sync_step: int | None = None
    """The training step of the weights being loaded, set by the syncs before `load_weights`, for the hook points
    a backend calls inside its load (hybridflow/utils/hooks.py; None: validation or no sync)."""

    def held_prints(self, names: list[str]) -> dict[str, int]:
        """With `prints_own_weights`: name -> fingerprint (parity/fingerprint.py) of the tensor held under each
        HF name of `names`; a name the backend cannot read back is left out and not compared."""
        raise NotImplementedError(f"{type(self).__name__} gives its tensors: use held_weights")

    def take_load_check_seconds(self) -> float:
        """Seconds the loads since the last call spent fingerprinting inside the backend for the weight check
        (vllm: the weights it repacks, as loaded), counted in timing_s/parity_weights; 0 by default."""
        return 0.0

    def stale_state(self) -> list[str]:
        """What the last load left stale besides the weights (vllm: a prefix cache not reset), each a phrase for
        the weight check's finding; [] when nothing is."""
        return []

    def turn_generator(
        self, sampling: SamplingParams, interruptible: bool = False
    ) -> contextlib.AbstractContextManager[GenerateFn | TurnEngine]:
        """The multi-turn capability (rollout.multi_turn, rollout/multi_turn.py): a context manager giving a
        `GenerateFn` that generates one turn for each of a batch of token-id contexts, each up to its own token
        budget, stopping at the rollout's EOS ids, with the log-prob of every sampled token (n=1), run in rounds;
        or a `TurnEngine` (agent/loop/runner.py), which gets each trajectory's key with its context, so it may keep
        a trajectory's cache between its turns and decode other trajectories while one's tool runs. A backend
        that implements it runs the agent loop; hf uses `ModuleRollout`'s, native its turn engine
        (rollout/native/turns.py) where that covers the model. `interruptible=True` (partial rollout,
        rollout/partial.py): a `GenerateFn` whose calls a weight push may cut (`ModuleRollout.interrupted`) and whose
        next call generates with the weights loaded meanwhile."""
        raise NotImplementedError(
            f"rollout.multi_turn needs a rollout that generates turn by turn: {type(self).__name__} does not "
            "implement Rollout.turn_generator (hybridflow/rollout/base.py says what it returns)"
        )


def load_state_dict_into(model: nn.Module, state_dict: dict[str, Tensor], partial: bool = False) -> None:
    """Copy every tensor of `state_dict` in place into `model`, cast to the model's dtype.

    Keys must be the model's own `state_dict()` keys. Tied parameters (e.g. lm_head and
    the input embedding) are written once; the state dict may hold either or both names.
    `partial`: the state dict may hold any subset of the weights; the others are kept.
    Raises KeyError for unknown or (unless `partial`) missing keys, ValueError for a shape mismatch.
    """
    targets = model.state_dict(keep_vars=True)
    unknown = sorted(set(state_dict) - set(targets))
    if unknown:
        raise KeyError(
            f"load_weights: {len(unknown)} keys are not in the rollout model, e.g. {unknown[:3]}; "
            f"expected keys like {list(targets)[:3]} (strip wrapper prefixes such as '_orig_mod.')"
        )
    written: set[int] = set()
    with torch.no_grad():
        for key, src in state_dict.items():
            dst = targets[key]
            if id(dst) in written:
                continue
            if dst.shape != src.shape:
                raise ValueError(
                    f"load_weights: {key} has shape {tuple(src.shape)}, the rollout model expects {tuple(dst.shape)}"
                )
            dst.copy_(src)
            written.add(id(dst))
    missing = [k for k, t in targets.items() if id(t) not in written]
    if missing and not partial:
        raise KeyError(
            f"load_weights: the state dict lacks {len(missing)} of the model's keys, e.g. "
            f"{missing[:3]}; pass the engine's full state dict"
        )


def left_padded(rows: list[list[int]], pad_id: int) -> DataProto:
    """Token id lists as a left-padded prompt batch (input_ids, attention_mask, position_ids)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({INPUT_IDS: ids, ATTENTION_MASK: mask, POSITION_IDS: pos})


def step_seed(seed: int, step: int) -> int:
    """The sampler seed of training step `step` (a large odd stride keeps steps and ranks apart)."""
    return seed + 1_000_003 * step


def eos_token_ids(tokenizer, model: nn.Module | None = None, generation_config: Any = None) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's EOS ids (that of `model`,
    or `generation_config` where the model is not loaded here)."""
    ids = [tokenizer.eos_token_id]
    gen_cfg = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    extra = getattr(gen_cfg, "eos_token_id", None)
    ids += extra if isinstance(extra, (list, tuple)) else [extra]
    ids = sorted({int(i) for i in ids if i is not None})
    if not ids:
        raise ValueError(
            "the tokenizer has no eos_token_id and the model's generation_config none either; set tokenizer.eos_token"
        )
    return ids


def load_rollout_model(model_path_or_module: str | os.PathLike | nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model to generate with: loaded from a local HF dir in `dtype`, or a given module.

    A given module is used as is (it may be shared with a trainer), so its dtype must
    already be `dtype`.
    """
    if isinstance(model_path_or_module, nn.Module):
        have = next(model_path_or_module.parameters()).dtype
        if have != dtype:
            raise ValueError(
                f"the rollout model is {have} but rollout.dtype asks for {dtype}; "
                "pass a model path (loaded in rollout.dtype) or set rollout.dtype to match"
            )
        return model_path_or_module.eval()

    return load_causal_lm(model_path_or_module, dtype=dtype).eval()


class ModuleRollout(Rollout):
    """Shared logic of the in-process backends (native, hf) over an HF causal-LM module.

    Handles sampling-param resolution, input checks, chunking by `max_batch_size`,
    the output layout and weight loading; subclasses implement `_generate`.
    """

    def __init__(self, config: RolloutConfig, model: nn.Module, tokenizer) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.generator = torch.Generator().manual_seed(config.seed)
        self.interrupted = threading.Event()
        """Set from another thread, it ends the generation in progress after its current decode step: every row
        keeps the tokens sampled so far (tensor parallel size 1 only). Whoever sets it clears it; the OpenAI
        server's batcher does when every request of its batch was abandoned (endpoint/backend.py)."""

    def turn_generator(
        self, sampling: SamplingParams, interruptible: bool = False
    ) -> contextlib.AbstractContextManager[GenerateFn]:
        """See `Rollout.turn_generator`: one `generate_sequences` call per round on the left-padded contexts,
        with the largest budget as response length, each row cut at its own (interruptible either way)."""

        def generate(batch: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
            self._check_turn_inputs(batch, budgets)
            width = max(len(ids) for ids in batch)
            base = self.config
            self.config = dataclasses.replace(
                base, prompt_length=width, response_length=max(budgets), calculate_log_probs=True
            )
            try:
                out = self.generate_sequences(left_padded(batch, self.pad_id), sampling)
            finally:
                self.config = base
            ids, mask, logps = (out.batch[k] for k in (RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS))
            lengths = [min(int(m.sum()), b) for m, b in zip(mask, budgets)]
            return [TurnOutput(ids[i, :n].tolist(), logps[i, :n].tolist()) for i, n in enumerate(lengths)]

        return contextlib.nullcontext(generate)

    def _check_turn_inputs(self, batch: list[list[int]], budgets: list[int]) -> None:
        """Before each round of the agent loop: raise where the round cannot run as given (a backend split over
        ranks checks that they agree); nothing here."""

    def load_weights(self, state_dict: dict[str, Tensor], partial: bool = False) -> None:
        """Copy the state dict into the model in place (cast to rollout dtype, tied weights once)."""
        load_state_dict_into(self.model, state_dict, partial)

    def reseed(self, step: int) -> None:
        """See `Rollout.reseed`."""
        self.generator.manual_seed(step_seed(self.config.seed, step))

    def held_weights(self) -> dict[str, Tensor]:
        """See `Rollout.held_weights`: the module's own tensors (tied ones under both names, one object)."""
        return dict(self.model.state_dict(keep_vars=True))

    def share_weights(self, tensors: dict[str, Tensor]) -> bool:
        """See `Rollout.share_weights`: the module's parameters are re-pointed at `tensors` when they match by
        name, shape, dtype and device (the copy they held is freed); False, with nothing changed, otherwise."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if set(params) != set(tensors) or any(
            (p.shape, p.dtype, p.device) != (t.shape, t.dtype, t.device)
            for p, t in zip(params.values(), (tensors[n] for n in params))
        ):
            return False
        with torch.no_grad():
            for name, p in params.items():
                p.data = tensors[name].detach()
        return True

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the generating model's weights."""
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def generate_sequences(self, prompts: DataProto, sampling: SamplingParams | None = None) -> DataProto:
        """See `Rollout.generate_sequences`."""
        params = sampling or self.config.sampling_params()
        ids, mask, pos = self._prompt_tensors(prompts)
        per_chunk = max(1, self.config.max_batch_size // params.n)
        parts = [
            self._generate(
                *trim_left_padding(ids[i : i + per_chunk], mask[i : i + per_chunk], pos[i : i + per_chunk]), params
            )
            for i in range(0, len(ids), per_chunk)
        ]
        responses, resp_mask, log_probs, sampled = (torch.cat([p[j] for p in parts]) for j in range(4))
        if not self.config.calculate_log_probs:
            log_probs = None
        return build_output(prompts, ids, mask, pos, responses, resp_mask, params.n, log_probs, sampled)

    def _prompt_tensors(self, prompts: DataProto) -> tuple[Tensor, Tensor, Tensor]:
        missing = [k for k in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS) if k not in prompts.batch.keys()]
        if missing:
            raise KeyError(
                f"generate_sequences: prompts lack {missing}; expected input_ids, attention_mask "
                "and position_ids (left-padded) as produced by the dataset collate"
            )
        ids = prompts.batch[INPUT_IDS]
        if ids.shape[1] > self.config.prompt_length:
            raise ValueError(
                f"prompts are {ids.shape[1]} tokens wide, more than rollout.prompt_length="
                f"{self.config.prompt_length}; raise rollout.prompt_length or shorten the prompts"
            )
        mask = prompts.batch[ATTENTION_MASK]
        if bool((mask[:, -1] == 0).any()):
            raise ValueError(
                "generate_sequences: prompts must be LEFT-padded (attention_mask[:, -1] is 0 "
                "for some rows); set tokenizer.padding_side='left'"
            )
        return ids, mask, prompts.batch[POSITION_IDS]

    @abstractmethod
    def _generate(
        self, ids: Tensor, mask: Tensor, pos: Tensor, params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Generate for one chunk; returns (responses, response_mask, log_probs), each [b*n, R],
        responses already pad-filled outside the mask, and [b*n] the `protocol/token_hash.py` hash of each row's
        sampled ids, taken from what the sampler drew."""


def trim_left_padding(ids: Tensor, mask: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Drop the leading columns that are padding in every row. Prompts arrive padded to
    `data.max_prompt_length` (128 by default) while the main job's are ~46 tokens: the prefill's
    cost is linear in the width, so untrimmed it ran ~2.8x the needed tokens (validation: 64 rows,
    12.2 s of a 16.8 s generate call). Outputs keep the caller's width (build_output)."""
    used = mask.bool().any(dim=0).nonzero()
    first = int(used[0]) if len(used) else 0
    return ids[:, first:], mask[:, first:], pos[:, first:]


def tensor_parallel_group(tp: int, stride: int = 1):
    """This rank's group of `tp` ranks of the default group, `stride` apart: the ranks laid out as
    (outer, tp, stride), stride fastest; 1 gives consecutive ranks (collective: every rank calls it)."""
    mesh = GenerationDims(dist.get_world_size(), tp, stride).build_mesh(device_kind())
    return mesh.get_group(Axis.TP.value)
