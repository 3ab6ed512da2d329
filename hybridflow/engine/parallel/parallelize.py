"""One model, parallelised in steps: tensor parallel, Ulysses attention, activation checkpointing, FSDP2.

`parallelize(model, dims, cfg)` applies to the same module, in this order (torchtitan's
`parallelize_llama` shape), each step only when its size is > 1 (checkpointing when asked for):

1. tensor parallel (hybridflow/engine/parallel/tensor_parallel.py): each decoder layer's projections split
   over the tp axis of the parameter mesh; the remaining parameters become Replicate DTensors there;
2. Ulysses sequence parallel (hybridflow/engine/parallel/sequence_parallel.py): the attention implementation
   that all-to-alls q/k/v over the sp group; with tensor parallel it splits the heads this tp rank
   holds, so sp may be at most num_attention_heads / tp;
3. activation checkpointing of the decoder layers;
4. FSDP2: `fully_shard` on every decoder layer, then on the root, over the dp x sp ranks of each (pp, tp)
   slot (dp_replicate x dp_shard, `ParallelDims`).

With pipeline parallel the model is first cut to this rank's stage (engine/parallel/pipeline_stage.py); the steps
then apply to the stage as to a whole model, and the pp axis of the parameter mesh links the stages.

Steps compose because each leaves the module an ordinary `nn.Module` the next one can take: the
layouts tp x sp, tp, sp and plain FSDP are the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hybridflow.engine.config import EngineConfig, dtype_of
from hybridflow.engine.parallel.dims import Axis, ParallelDims
from hybridflow.engine.parallel.pipeline_stage import PipelineStageModule
from hybridflow.engine.parallel.sequence_parallel import SPLayout, apply_ulysses
from hybridflow.engine.parallel.tensor_parallel import check_tp_layout, parallelize_layers, replicate_rest
from hybridflow.engine.prefix_attention import use_prefix_attention
from hybridflow.models.loading import enable_activation_checkpointing
from hybridflow.models.value import ValueModel


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF model (its `_no_split_modules` classes)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find decoder layers in {type(model).__name__} to shard")
    return layers


@dataclass
class Parallelized:
    """What `parallelize` built around the model, for the engine that runs it."""

    fsdp_mesh: DeviceMesh
    """The mesh FSDP2 shards over (dp_shard, or dp_replicate x dp_shard)."""
    tp_mesh: DeviceMesh
    """The tensor-parallel axis of the parameter mesh (size 1 without tensor parallel)."""
    sp: SPLayout | None
    """The Ulysses layout the attention modules share; None without sequence parallel."""
    reshard_after_forward: bool
    """Whether FSDP2 frees gathered parameters after each forward (False where FSDP2 is not applied)."""
    pp_group: dist.ProcessGroup | None = None
    """The ranks that hold the other stages of this rank's pipeline (stage i is group rank i); None without pp."""
    prefix_attention: bool = False
    """Whether the model runs engine/prefix_attention.py, which shared-prompt rows hand their layout to."""


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside `model`: a value model's backbone, a peft model's base model, the (cut down)
    model of a pipeline stage, or itself."""
    if isinstance(model, PipelineStageModule):
        return model.parts.hf
    if isinstance(model, ValueModel):
        return model.backbone
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def parallelize(model: nn.Module, dims: ParallelDims, cfg: EngineConfig) -> Parallelized:
    """Apply tensor parallel, Ulysses attention, activation checkpointing and FSDP2 to `model` (on its device)
    in place, as `dims` and `cfg` ask. A collective: every rank of the world calls it."""
    device_type = next(model.parameters()).device.type
    param_mesh = dims.build_param_mesh(device_type)
    tp_mesh = param_mesh[Axis.TP.value]
    layers = decoder_layers(model)
    hf = model.config
    if dims.tp > 1:
        check_tp_layout(dims.tp, dims.world, hf.num_attention_heads, hf.num_key_value_heads)
        parallelize_layers(layers, tp_mesh)
        replicate_rest(model, tp_mesh)
    sp = None
    if dims.sp > 1:
        sp_mesh = dims.build_mesh(device_type)[Axis.SP.value]
        sp = apply_ulysses(model, sp_mesh, dims.tp)
    prefix = cfg.share_prompts and sp is None and use_prefix_attention(hf_model(model))
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(hf_model(model))
    fsdp_mesh = dims.fsdp_submesh(param_mesh)
    reshard = _apply_fsdp(model, layers, fsdp_mesh, cfg, device_type) if needs_fsdp(model, dims, cfg) else False
    pp_group = param_mesh[Axis.PP.value].get_group() if dims.pp > 1 else None
    return Parallelized(fsdp_mesh, tp_mesh, sp, reshard, pp_group, prefix)


def needs_fsdp(model: nn.Module, dims: ParallelDims, cfg: EngineConfig) -> bool:
    """Whether FSDP2 wraps the model: it shards across ranks and casts to param_dtype for compute. A world of
    one rank computing in the weights' own dtype needs neither, and FSDP2 there would still gather every layer
    into a copy and reduce its gradients through another (SmolLM2 fp32, 1x2 update: ~0.9 GB more RSS at the
    peak, BENCHMARKS.md); the plain module trains bit-identically."""
    weights = next(model.parameters()).dtype
    return dims.world > 1 or dtype_of(cfg.param_dtype) != weights


def _apply_fsdp(
    model: nn.Module, layers: list[nn.Module], mesh: DeviceMesh, cfg: EngineConfig, device_type: str
) -> bool:
    """`fully_shard` every decoder layer, then the root; returns whether parameters reshard after forward."""
    policy = MixedPrecisionPolicy(param_dtype=dtype_of(cfg.param_dtype), reduce_dtype=dtype_of(cfg.reduce_dtype))
    # One rank per shard group still gathers into a copy of the weights: resharding frees it between passes.
    reshard = cfg.resolve_reshard_after_forward(torch.device(device_type), mesh.size(-1))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return reshard
