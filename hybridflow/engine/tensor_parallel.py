"""Tensor parallel x FSDP2: the FSDP engine on a 2-D (or, with HSDP, 3-D) device mesh.

The world of `world` ranks is laid out as dp x tp, tp fastest (global rank = dp_rank * tp + tp_rank):
the tp ranks of one dp group hold the same rows of the batch and split every decoder layer
between them with DTensor tensor parallel (Megatron's split: q/k/v and gate/up by output
columns, o and down by input rows, one all-reduce after attention and one after the MLP in
the forward, the same in the backward); FSDP2 then shards the tp shards over dp (x
replicas by `fsdp_size`, as in `FSDPEngine`). Attention needs no change: each rank runs the
heads whose q/k/v columns it holds (HF attention reshapes with -1 heads).

What stays whole on every tp rank: the embedding, the norms, the LM head (or value head).
Their parameters become Replicate DTensors on the tp mesh so that every parameter lives on
the one dp x tp mesh (one gradient norm, one fused AdamW, one checkpoint layout); their
inputs and outputs stay plain tensors. Splitting the embedding / LM head by vocabulary
(and the log-softmax with it) would save their FLOPs and memory; not done here.

Everything the FSDP engine does to a micro-batch (padding removal, packing, shared-prompt
packing with its 4-D mask, token budgets) splits tokens or rows, never heads, so it runs
unchanged: the tp ranks of a dp group get the same rows and cut the same micro-batches.

Pipeline parallelism would plug in as a third mesh dim (pp, outermost): each pp rank keeps a
contiguous slice of `decoder_layers`, `train_step` becomes a schedule over micro-batches
(torch.distributed.pipelining), and the log-probs come from the last stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hybridflow.engine.config import EngineConfig, dtype_of
from hybridflow.engine.fsdp import FSDPEngine, decoder_layers

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


def build_meshes(device_type: str, world: int, config: EngineConfig) -> tuple[DeviceMesh, DeviceMesh]:
    """(dp mesh for FSDP2, tp mesh), both slices of one world mesh with tp as its last (fastest) dim."""
    tp = config.tensor_parallel_size
    dp = world // tp
    shard = config.resolve_fsdp_size(torch.device(device_type), world)
    if shard == dp:
        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        return mesh["dp_shard"], mesh["tp"]
    mesh = init_device_mesh(device_type, (dp // shard, shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    return mesh["dp_replicate", "dp_shard"], mesh["tp"]


def _style(kind: str) -> ColwiseParallel | RowwiseParallel:
    return ColwiseParallel() if kind == "colwise" else RowwiseParallel()


def parallelize_layers(model: nn.Module, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every decoder layer's attention and MLP projections over `tp_mesh`; return the layers."""
    layers = decoder_layers(model)
    for layer in layers:
        missing = [name for name in LAYER_PLAN if not _has(layer, name)]
        if missing:
            raise ValueError(
                f"tensor parallel supports Llama/Qwen2-style decoder layers; {type(layer).__name__} has no {missing}"
            )
        parallelize_module(layer, tp_mesh, {name: _style(kind) for name, kind in LAYER_PLAN.items()})
    return layers


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


class TensorParallelEngine(FSDPEngine):
    """`FSDPEngine` with each decoder layer split over `EngineConfig.tensor_parallel_size` ranks.

    `rank` / `world_size` stay the global ones (checkpoints write per global rank); `dp_rank`,
    `dp_size`, `tp_rank` and `tp_size` give this rank's place in the dp x tp layout. Adapters
    (LoRA) are refused: peft wraps the very projections tensor parallel splits.
    """

    def __init__(self, model: nn.Module, config: EngineConfig, optim=None, lora=None) -> None:
        if lora is not None and lora.enabled:
            raise ValueError("engine.tensor_parallel_size > 1 does not combine with LoRA adapters (lora.rank > 0)")
        super().__init__(model, config, optim, lora)

    def _shard(self, model: nn.Module) -> nn.Module:
        world, tp = dist.get_world_size(), self.config.tensor_parallel_size
        hf = model.config
        check_tp_layout(tp, world, hf.num_attention_heads, hf.num_key_value_heads)
        dp_mesh, tp_mesh = build_meshes(self.device.type, world, self.config)
        self.dp_mesh, self.tp_mesh = dp_mesh, tp_mesh
        layers = parallelize_layers(model, tp_mesh)
        replicate_rest(model, tp_mesh)
        policy = MixedPrecisionPolicy(
            param_dtype=dtype_of(self.config.param_dtype), reduce_dtype=dtype_of(self.config.reduce_dtype)
        )
        reshard = self.config.resolve_reshard_after_forward(self.device) and dp_mesh.size(-1) > 1
        self._reshard_after_forward = reshard
        kwargs = dict(mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    @property
    def tp_size(self) -> int:
        """Ranks each decoder layer is split over."""
        return self.tp_mesh.size()

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tp group."""
        return self.tp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        """Number of dp groups (distinct shards of the batch)."""
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        """Which shard of the batch this rank holds."""
        return self.rank // self.tp_size
