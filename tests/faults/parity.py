"""Parity faults: break one thing at one step, to show the parity guard catches it.

A spec is comma-separated points `KIND@STEP`, e.g. "skip_sync@2,corrupt_tensor@3": at training step STEP the code
path that owns KIND misbehaves in that one way (in every process that reaches it), through the hook points of the
weight sync (hybridflow/rollout/sync.py), the generate worker (workers/actor_rollout_ref.py) and the vllm rollout.
While any parity fault is armed a rollout keeps its own copy of the weights (`weight_sync.keep_copy`): the faults
break that copy, never the trainer's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hybridflow.engine.reshard import GenerationLayout
from hybridflow.engine.reshard_plan import unique_tensors
from hybridflow.protocol import keys as K

KINDS: dict[str, str] = {
    # weight sync paths (what breaks, where)
    "skip_sync": "a weight sync loads nothing: the rollout keeps its stale weights (every sync path)",
    "corrupt_tensor": "one element of one rollout tensor is altered after the load (every sync path)",
    "wrong_dtype": "the weights pass through a lossy dtype on the way into the rollout (every sync path)",
    "wrong_shard": "the reshard gives each rank of a tp group another rank's generation shard (reshard)",
    "bridge_drop": "a rollout worker receives an update over the weight bridge but does not load it (bridge)",
    "lora_unmerged": "a LoRA sync sends the adapted layers' base weights, without the adapters (lora)",
    "prefix_cache_stale": "the vllm rollout reloads the weights but does not reset its prefix cache (vllm)",
    # log-prob / token paths
    "token_edit": "the generate worker changes the first trained token of its first row after sampling",
    "logprob_skew": "the generate worker lowers every rollout log-prob by 0.5 nats after sampling",
}
"""Every fault kind and what it breaks; `parse_parity_faults` refuses any other."""
_POINT_RE = re.compile(r"^(?P<kind>\w+)@(?P<step>\d+)$")
LOSSY = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float8_e4m3fn, torch.float16: torch.float8_e4m3fn}
"""wrong_dtype: the dtype each rollout dtype passes through (fewer mantissa bits: lossy for any real weights)."""
SKEW_NATS = 0.5
"""What `logprob_skew` subtracts from each rollout log-prob."""


def parse_parity_faults(spec: str) -> dict[str, set[int]]:
    """kind -> the steps it fires at; a malformed point or an unknown kind raises naming the expected form."""
    points: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = _POINT_RE.match(part)
        if match is None or match["kind"] not in KINDS:
            raise ValueError(f"bad parity fault {part!r}; expected KIND@STEP with KIND one of {sorted(KINDS)}")
        points.setdefault(match["kind"], set()).add(int(match["step"]))
    return points


class ParityFaults:
    """The hooks that break what a spec names, at its steps (`hooks()`: point name -> hook)."""

    def __init__(self, spec: str) -> None:
        self.points = parse_parity_faults(spec)

    def at(self, kind: str, step: int | None) -> bool:
        """Whether fault `kind` fires at training step `step` (None, e.g. validation: never)."""
        return step is not None and step in self.points.get(kind, set())

    def hooks(self) -> dict[str, Callable[..., Any]]:
        return {
            "weight_sync.keep_copy": lambda rollout, engine: True,
            "weight_sync.before_load": self.before_load,
            "weight_sync.skip_load": self.skip_load,
            "weight_sync.reshard_layout": self.reshard_layout,
            "weight_sync.loaded": self.loaded,
            "rollout.generated": self.generated,
            "vllm.skip_prefix_cache_reset": lambda rollout, step: self.at("prefix_cache_stale", step),
        }

    def before_load(self, state: dict[str, Tensor], rollout: Any, engine: Any, step: int | None, path: str):
        """lora_unmerged: the base weights under the merged ones' names; wrong_dtype into vllm (whose tensors
        cannot be altered after the load): a lossy cast on the way in."""
        if path == "lora" and self.at("lora_unmerged", step):
            return {**state, **base_weights(engine, rollout.weight_dtype)}
        if rollout.prints_own_weights and self.at("wrong_dtype", step):
            return {name: t.to(LOSSY[t.dtype]).to(t.dtype) for name, t in state.items()}
        return None

    def skip_load(self, rollout: Any, step: int | None, path: str) -> bool:
        return self.at("skip_sync", step) or (path == "bridge" and self.at("bridge_drop", step))

    def reshard_layout(self, layout: GenerationLayout, step: int | None) -> GenerationLayout | None:
        if self.at("wrong_shard", step):
            return MirroredLayout(layout.tp, layout.split_dims, layout.stride)
        return None

    def loaded(self, rollout: Any, step: int | None, path: str) -> None:
        """corrupt_tensor and wrong_dtype on the tensors the rollout holds; vllm's through its worker."""
        if rollout.prints_own_weights:
            if self.at("corrupt_tensor", step):
                rollout.llm.collective_rpc(corrupt_in_vllm_worker)
            return
        held = rollout.held_weights()
        if held is None:
            return
        if self.at("corrupt_tensor", step):
            corrupt(held)
        if self.at("wrong_dtype", step):
            with torch.no_grad():
                for _, t in unique_tensors(held):
                    t.copy_(t.to(LOSSY[t.dtype]).to(t.dtype))

    def generated(self, out: Any, step: int | None) -> None:
        """token_edit and logprob_skew on a generate worker's output."""
        if self.at("token_edit", step):
            edit_first_trained_token(out)
        if self.at("logprob_skew", step) and K.ROLLOUT_LOG_PROBS in out.batch.keys():
            mask = out.batch[K.RESPONSE_MASK]
            out.batch[K.ROLLOUT_LOG_PROBS] = out.batch[K.ROLLOUT_LOG_PROBS] - SKEW_NATS * mask


@dataclass(frozen=True)
class MirroredLayout(GenerationLayout):
    """wrong_shard: the layout with each tp group's ranks in reverse order, so every rank of a group of two
    or more receives another rank's generation shard (consistently on every rank: the reshard still completes)."""

    def tp_index(self, rank: int) -> int:
        """The mirror image of the true place in the tp group."""
        return self.tp - 1 - super().tp_index(rank)


def base_weights(engine: Any, dtype: torch.dtype | None) -> dict[str, Tensor]:
    """lora_unmerged: the adapted layers' frozen base weights, gathered (a collective), under the names the
    merged ones are sent under."""
    from hybridflow.engine.gather import gather_named  # noqa: PLC0415  (lazy: LoRA runs only)
    from hybridflow.engine.lora import adapted_layers, hf_name  # noqa: PLC0415

    named = {hf_name(f"{name}.weight"): layer.base_layer.weight for name, layer in adapted_layers(engine.module)}
    return gather_named(named, dtype)


@torch.no_grad()
def corrupt(held: Mapping[str, Tensor]) -> None:
    """corrupt_tensor: add 1 to the first element of the first 2-D decoder-layer weight (else the first tensor)."""
    name = next((n for n, t in held.items() if ".layers." in n and t.dim() == 2), next(iter(held)))
    held[name].view(-1)[0] += 1.0


def corrupt_in_vllm_worker(worker: Any) -> None:
    """corrupt_tensor inside vllm's worker (`LLM.collective_rpc`), on the tensors it holds under HF names that can
    be read back (rollout/vllm/weights.py)."""
    from hybridflow.rollout.vllm.weights import hf_views  # noqa: PLC0415  (vllm runs only)

    views = hf_views(worker.model_runner.get_model())
    corrupt({name: t for name, t in views.items() if isinstance(t, Tensor)})


def edit_first_trained_token(out: Any) -> None:
    """token_edit: row 0's first trained token becomes another id, in `responses` and `input_ids` alike (a
    consistent batch, as a re-tokenization would leave it)."""
    trained = out.batch[K.RESPONSE_MASK][0].nonzero()
    if len(trained) == 0:
        return
    col = int(trained[0])
    responses, input_ids = out.batch[K.RESPONSES].clone(), out.batch[K.INPUT_IDS].clone()  # not inference tensors
    old = int(responses[0, col])
    responses[0, col] = input_ids[0, out.batch[K.PROMPTS].shape[1] + col] = old - 1 if old > 0 else old + 1
    out.batch[K.RESPONSES], out.batch[K.INPUT_IDS] = responses, input_ids
