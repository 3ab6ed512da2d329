"""Tensor parallel: the plan that splits each decoder layer over the tp axis (step 1 of engine/parallel/parallelize.py).

The world is laid out as dp x sp x tp, tp fastest (engine/parallel/dims.py):
the tp ranks of one dp group hold the same rows of the batch and split every decoder layer
between them with DTensor tensor parallel (Megatron's split: q/k/v and gate/up by output
columns, o and down by input rows, one all-reduce after attention and one after the MLP in
the forward, the same in the backward); FSDP2 then shards the tp shards over the dp x sp ranks
(x replicas by `fsdp_size`, engine/parallel/parallelize.py). Attention needs no change: each rank runs the
heads whose q/k/v columns it holds (HF attention reshapes with -1 heads).

What stays whole on every tp rank: the embedding, the norms, the LM head (or value head).
Their parameters become Replicate DTensors on the tp mesh so that every parameter lives on
the one parameter mesh (one gradient norm, one fused AdamW, one checkpoint layout); their
inputs and outputs stay plain tensors. Splitting the embedding / LM head by vocabulary
(and the log-softmax with it) would save their FLOPs and memory; not done here.

Everything the FSDP engine does to a micro-batch (padding removal, packing, shared-prompt
packing with its 4-D mask, token budgets) splits tokens or rows, never heads, so it runs
unchanged: the tp ranks of a dp group get the same rows and cut the same micro-batches.

With pipeline parallel (engine/parallel/pipeline.py, the outermost mesh dim) each stage's decoder layers are split
the same way over the tp ranks of its slot.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

LAYER_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""Submodule of a Llama/Qwen2-style decoder layer -> how tensor parallel splits it."""


def check_tp_layout(
    tp: int, world: int, num_heads: int, num_kv_heads: int, key: str = "engine.tensor_parallel_size"
) -> None:
    """Refuse a layout tensor parallel cannot run: tp must divide the ranks, the heads and the kv heads
    (`key`: the config key named in the message)."""
    if tp < 1:
        raise ValueError(f"{key} must be >= 1, got {tp}")
    problems = [
        f"{what} ({n})"
        for what, n in (
            ("the number of ranks", world),
            ("num_attention_heads", num_heads),
            ("num_key_value_heads", num_kv_heads),
        )
        if n % tp
    ]
    if problems:
        raise ValueError(
            f"{key}={tp} must divide "
            + ", ".join(problems)
            + f"; the model has {num_heads} attention heads and {num_kv_heads} kv heads"
        )


def _style(kind: str) -> ColwiseParallel | RowwiseParallel:
    return ColwiseParallel() if kind == "colwise" else RowwiseParallel()


def parallelize_layers(layers: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Split every decoder layer's attention and MLP projections over `tp_mesh`."""
    for layer in layers:
        missing = [name for name in LAYER_PLAN if not _has(layer, name)]
        if missing:
            raise ValueError(
                f"tensor parallel supports Llama/Qwen2-style decoder layers; {type(layer).__name__} has no {missing}"
            )
        parallelize_module(layer, tp_mesh, {name: _style(kind) for name, kind in LAYER_PLAN.items()})


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def replicate_rest(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Turn every parameter that is not yet a DTensor into a Replicate DTensor on `tp_mesh` (tied
    parameters stay tied), and make its module take and return plain tensors."""
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        names = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not names:
            continue
        if any(isinstance(p, DTensor) for child in module.children() for p in child.parameters()):
            # its hooks would hand DTensors to the split layers below it, which expect plain tensors
            raise ValueError(
                f"tensor parallel: {type(module).__name__} holds parameters of its own around "
                "split decoder layers; only Llama/Qwen2-style models are supported"
            )
        for name in names:
            p = module._parameters[name]
            if id(p) not in converted:
                full = distribute_tensor(p.data, tp_mesh, [Replicate()])
                converted[id(p)] = nn.Parameter(full, requires_grad=p.requires_grad)
            module._parameters[name] = converted[id(p)]
        module.register_forward_pre_hook(_inputs_to_dtensor(tp_mesh), with_kwargs=True)
        module.register_forward_hook(_outputs_to_local)


def _inputs_to_dtensor(mesh: DeviceMesh):
    def to_dtensor(x: Any) -> Any:
        if torch.is_tensor(x) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(to_dtensor(a) for a in args), {k: to_dtensor(v) for k, v in kwargs.items()}

    return hook


def _outputs_to_local(_module: nn.Module, _args: tuple, output: Any) -> Any:
    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in output)
    return output
