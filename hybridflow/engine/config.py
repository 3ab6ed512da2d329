"""Typed configs of a training engine: the optimizer/LR schedule and the engine itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridflow.engine.parallel.dims import check_divides, fsdp_shard_size
from hybridflow.utils.config_loader import Section
from hybridflow.utils.dtypes import check_dtype, dtype_of

__all__ = ["EngineConfig", "LoraConfig", "OptimConfig", "dtype_of"]


@dataclass
class OptimConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 disables clipping (the norm is still reported)."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warmup: constant at `lr`, or cosine decay to `lr * min_lr_ratio`."""
    lr_warmup_steps_ratio: float = 0.0
    """Fraction of `total_training_steps` spent in linear warmup from 0 to `lr` (read when lr_warmup_steps
    is null, 0 or negative)."""
    lr_warmup_steps: int | None = -1
    """Steps of linear warmup; wins over lr_warmup_steps_ratio when > 0. null, 0 or negative: the ratio
    decides (verl's documented meaning; -1 is verl's default)."""
    min_lr_ratio: float = 0.0
    """Final LR of the cosine schedule as a fraction of `lr`."""
    total_training_steps: int | None = None
    """Length of the LR schedule in training steps (warmup/cosine); None: the run's total steps
    (filled in when the run is resolved). Set it to run part of a longer schedule."""

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr}")
        if self.lr_scheduler not in ("constant", "cosine"):
            raise ValueError(f"optim.lr_scheduler must be 'constant' or 'cosine', got {self.lr_scheduler!r}")
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(f"optim.lr_warmup_steps_ratio must be in [0, 1], got {self.lr_warmup_steps_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))


@dataclass
class EngineConfig(Section):
    """How one model runs on its process group (FSDP2)."""

    param_dtype: Literal["fp32", "bf16", "auto"] = "auto"
    """Compute dtype of forward/backward; master weights and optimizer state stay fp32. auto: bf16 on
    a GPU that has it; on CPU bf16 where a matmul probe measures it >= 1.5x fp32 (once per machine)."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the gradient reduce-scatter across data-parallel ranks."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward to save memory."""
    use_remove_padding: bool = True
    """Drop the columns that are padding in every row of a micro-batch before the forward."""
    packing: bool = False
    """Run each micro-batch as one packed row of its real tokens (no padding at all), position ids
    restarting per example and attention kept inside each example (hybridflow/engine/batch.py `pack`).
    Supersedes use_remove_padding. Needs an attention backend that masks from position ids (sdpa, eager)."""
    share_prompts: bool = True
    """Run a micro-batch as one packed row in which the rows with the same prompt (the n samples of
    a prompt) share ONE copy of it, under a block mask (hybridflow/engine/prefix.py): no padding
    and no repeated prompt tokens, same outputs; used for the micro-batches where it costs fewer
    FLOPs than the trimmed layout (with SDPA, its attention computes only the pairs the mask
    allows: hybridflow/engine/prefix_attention.py). packing wins."""
    logits_chunk_size: int = 1024
    """Tokens per chunk when turning logits into log-probs/entropy (bounds fp32 memory)."""
    cpu_math_attention_max_len: int = 128
    """CPU training: micro-batches at most this many tokens wide run SDPA's math kernel, whose
    backward is ~3x faster than the CPU flash kernel's at 71 tokens (slower past ~200); 0: never."""
    cpu_keep_freed_memory: bool = True
    """CPU: set glibc malloc to keep freed blocks for reuse (process-wide; see hybridflow.utils.memory),
    so the buffers every step reallocates are not page-faulted in again (~12% of a 1-thread update)."""
    fsdp_size: int | None = None
    """Ranks each parameter is sharded over (verl: fsdp_size); the world is split into
    world/fsdp_size replicas of that (HSDP: gradients all-reduced across replicas).
    -1: the whole world (plain FSDP). 1: every rank holds the whole model (DDP-like: no
    parameter gathers, weight sync is a local copy). None: 1 on CPU (gloo collectives are
    slow and memory is plentiful), -1 on GPU."""
    tensor_parallel_size: int = 1
    """Ranks each decoder layer is split over by tensor parallel (verl: tensor_parallel_size); the
    world is laid out as dp x sp x tp (tp fastest, engine/parallel/dims.py) and `fsdp_size` shards over
    the dp x sp ranks. 1: off.
    Must divide the ranks, num_attention_heads and num_key_value_heads (checked when the run is
    resolved); Llama/Qwen2-style layers only, no LoRA (hybridflow/engine/parallel/tensor_parallel.py)."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks each micro-batch's tokens are split over by Ulysses sequence parallel (verl:
    ulysses_sequence_parallel_size): the world is laid out as dp x sp x tp (tp fastest), the sp ranks of a
    dp group share its rows, each runs 1/sp of every packed micro-batch's tokens, with all-to-alls around
    attention (hybridflow/engine/parallel/sequence_parallel.py); FSDP2 shards over the dp x sp ranks. 1: off. tp x sp
    must divide the ranks, and sp be <= num_attention_heads / tensor_parallel_size (heads may split
    unevenly; with more sp ranks than kv heads, k and v are repeated for their q heads)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages the decoder layers are split over (verl's Megatron key): stage i holds layers
    [i L/pp, (i+1) L/pp), the first also the embedding, the last the final norm and the LM (or value) head;
    micro-batches flow through torch.distributed.pipelining's schedules (GPipe forward-only, 1F1B training;
    hybridflow/engine/parallel/pipeline.py). The world is laid out as pp x dp x sp x tp (pp outermost); FSDP2 shards each
    stage over its dp ranks. 1: off. Must divide the ranks (with tp) and num_hidden_layers; not with
    ulysses_sequence_parallel_size > 1, packing, LoRA, or in SFT (refused at load)."""
    backend: str | None = None
    """Engine backend by name in hybridflow.workers.engines.ENGINES (or a module:function path to a builder).
    None: chosen from the layout, as before: "fsdp_tp" when tensor_parallel_size > 1, "fsdp_sp" when
    ulysses_sequence_parallel_size > 1, else "fsdp"."""
    reshard_after_forward: bool | None = None
    """FSDP2: free gathered parameters after forward (saves memory, costs a re-gather in backward). None: True
    on GPU; on CPU True where a shard group has one rank (fsdp_size 1: the "gather" is a local copy, and keeping
    every layer's copy from forward to backward held ~0.5 GB more for SmolLM2 in fp32), False across ranks (gloo
    gathers over loopback cost more than the memory). One rank computing in the weights' dtype (fp32) runs
    without FSDP2 at all (engine/parallel/parallelize.py `needs_fsdp`)."""

    def resolve_fsdp_size(self, device: torch.device, world: int) -> int:
        """`fsdp_size` for this world, with None and -1 resolved; it must divide the world size (with
        tensor parallel: the number of dp groups, world / tensor_parallel_size)."""
        return fsdp_shard_size(self, world, device)

    @property
    def ranks_per_dp_group(self) -> int:
        """Ranks that hold the same rows of the batch (tensor x sequence x pipeline parallel sizes)."""
        return self.tensor_parallel_size * self.ulysses_sequence_parallel_size * self.pipeline_model_parallel_size

    def dp_size(self, world: int, section: str = "engine.") -> int:
        """Data-parallel groups (distinct shards of the batch) among `world` ranks: world / (tp x sp x pp).
        `section`: the key path of this engine in the message ("actor.engine.", ...)."""
        tp, sp, pp = self.tensor_parallel_size, self.ulysses_sequence_parallel_size, self.pipeline_model_parallel_size
        check_divides(world, tp, sp, section, pp=pp)
        return world // self.ranks_per_dp_group

    def resolve_reshard_after_forward(self, device: torch.device, shard_ranks: int) -> bool:
        """`reshard_after_forward`, with None resolved for `device` and `shard_ranks` ranks per shard group."""
        if self.reshard_after_forward is None:
            return device.type != "cpu" or shard_ranks == 1
        return self.reshard_after_forward

    def __post_init__(self) -> None:
        check_dtype("engine.param_dtype", self.param_dtype)
        check_dtype("engine.reduce_dtype", self.reduce_dtype, allow_auto=False)
        if self.fsdp_size is not None and self.fsdp_size != -1 and self.fsdp_size < 1:
            raise ValueError(f"engine.fsdp_size must be -1, None or >= 1, got {self.fsdp_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"engine.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.ulysses_sequence_parallel_size < 1:
            raise ValueError(
                f"engine.ulysses_sequence_parallel_size must be >= 1, got {self.ulysses_sequence_parallel_size}"
            )
        self._check_pipeline()
        if self.cpu_math_attention_max_len < 0:
            raise ValueError(f"engine.cpu_math_attention_max_len must be >= 0, got {self.cpu_math_attention_max_len}")
        if self.logits_chunk_size < 1:
            raise ValueError(f"engine.logits_chunk_size must be >= 1, got {self.logits_chunk_size}")

    def _check_pipeline(self) -> None:
        pp = self.pipeline_model_parallel_size
        if pp < 1:
            raise ValueError(f"engine.pipeline_model_parallel_size must be >= 1, got {pp}")
        if pp > 1 and self.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                f"engine.pipeline_model_parallel_size={pp} does not combine with "
                f"engine.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} (not implemented)"
            )
        if pp > 1 and self.packing:
            raise ValueError(
                f"engine.pipeline_model_parallel_size={pp} does not combine with engine.packing=true: pipeline stages "
                "pass one [rows, columns] activation shape per call (micro-batches run trimmed and padded)"
            )


@dataclass
class LoraConfig(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021, through peft) on the model's linear layers."""

    rank: int = 0
    """Adapter rank r (verl: lora_rank); 0 disables LoRA, so every weight trains."""
    alpha: float = 16.0
    """Adapter updates are scaled by alpha / rank (verl: lora_alpha)."""
    target_modules: Any = "all-linear"
    """Linear layers that get adapters: "all-linear" (every projection but the LM head) or a list of
    module names such as [q_proj, v_proj] (verl: target_modules)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained instead of the full weights."""
        return self.rank > 0

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0: off), got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        ok = self.target_modules == "all-linear" or (
            isinstance(self.target_modules, (list, tuple))
            and self.target_modules
            and all(isinstance(m, str) and m for m in self.target_modules)
        )
        if not ok:
            raise ValueError(
                f"lora.target_modules must be 'all-linear' or a non-empty list of module names, "
                f"got {self.target_modules!r}"
            )
        if isinstance(self.target_modules, tuple):
            self.target_modules = list(self.target_modules)
