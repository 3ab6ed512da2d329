"""Parity fault injection, for tests only: break one thing at one step, to show the guard catches it.

    HYBRIDFLOW_PARITY_FAULT="skip_sync@2,corrupt_tensor@3"

Each comma-separated point is `KIND@STEP`: the code path that owns KIND asks `parity_fault(KIND, step)` and, when
it answers True, misbehaves in that one way at training step STEP (in every process that reaches that path; the
worker groups forward the variable like HYBRIDFLOW_FAULT, controller/faults.py). Unset, a check costs one
environment lookup.
"""

from __future__ import annotations

import os
import re

PARITY_FAULT_ENV = "HYBRIDFLOW_PARITY_FAULT"
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


def parse_parity_faults(spec: str) -> dict[str, set[int]]:
    """kind -> the steps it fires at; a malformed point or an unknown kind raises naming the expected form."""
    points: dict[str, set[int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = _POINT_RE.match(part)
        if match is None or match["kind"] not in KINDS:
            raise ValueError(
                f"{PARITY_FAULT_ENV}: bad point {part!r}; expected KIND@STEP with KIND one of {sorted(KINDS)}"
            )
        points.setdefault(match["kind"], set()).add(int(match["step"]))
    return points


def parity_fault(kind: str, step: int | None) -> bool:
    """Whether fault `kind` is set for training step `step` (None, e.g. validation: never)."""
    spec = os.environ.get(PARITY_FAULT_ENV)
    if not spec or step is None:
        return False
    return step in parse_parity_faults(spec).get(kind, set())
