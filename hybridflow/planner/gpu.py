"""Analytic operator costs on GPU clusters that are not here: named GPU specs, Llama shapes, roofline times.

The CPU cost model (planner/cost.py) starts from a measured run; a GPU cluster this project cannot
reach is predicted from first principles instead, the way the HybridFlow paper's simulator is
described: each operator's time is its FLOPs over the devices' peak times an efficiency, or, for a
decode step, the bytes it must read (weights + KV cache) over the memory bandwidth, whichever is
larger, plus the collectives its parallel layout adds (tensor-parallel all-reduces per layer, FSDP
parameter/gradient traffic, the train -> generate weight resharding). The efficiencies below are
assumptions (typical Megatron / vLLM figures on A100/H100), not measurements: the predictions rank
plans; their absolute seconds are estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

MFU_TRAIN = 0.40
"""Fraction of peak bf16 FLOPs a training pass (forward + backward) reaches (assumed)."""
MFU_FORWARD = 0.50
"""Fraction of peak a forward pass (log-probs, values, rewards, prefill) reaches (assumed)."""
HBM_EFFICIENCY = 0.70
"""Fraction of peak memory bandwidth a decode step's weight and KV-cache reads reach (assumed)."""
MEMORY_USABLE = 0.90
"""Fraction of device memory a plan may fill (the rest: allocator fragmentation, CUDA context)."""
TRAIN_STATE_BYTES = 16
"""Bytes per trained parameter with mixed precision: fp32 master + Adam moments (12) + bf16 param and grad (4)."""
INFER_STATE_BYTES = 2
"""Bytes per parameter of a model that only runs forward (bf16)."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type and the links around it."""

    name: str
    """Spec name (SPECS key)."""
    bf16_flops: float
    """Dense bf16 peak FLOP/s."""
    memory_bytes: float
    """Device memory."""
    hbm_bytes_per_s: float
    """Peak memory bandwidth."""
    intra_node_bytes_per_s: float
    """NVLink bandwidth per GPU and direction (what a ring collective inside a node runs at)."""
    inter_node_bytes_per_s: float
    """Network bandwidth per GPU and direction across nodes."""
    gpus_per_node: int = 8
    """GPUs sharing NVLink; tensor parallel stays inside a node."""
    collective_latency_s: float = 20e-6
    """Fixed cost of one collective call."""


SPECS: dict[str, GpuSpec] = {
    # DGX-A100-like node: 8 x A100-SXM4-80GB, NVLink 3 (600 GB/s both directions), 8 x 200 Gb/s HDR.
    "a100-80gb": GpuSpec("a100-80gb", 312e12, 80e9, 2.0e12, 300e9, 25e9),
    # DGX-H100-like node: 8 x H100-SXM5-80GB, NVLink 4 (900 GB/s), 8 x 400 Gb/s NDR.
    "h100-80gb": GpuSpec("h100-80gb", 989e12, 80e9, 3.35e12, 450e9, 50e9),
    "h200-141gb": GpuSpec("h200-141gb", 989e12, 141e9, 4.8e12, 450e9, 50e9),
}
"""Named GPU specs (vendor datasheet peaks)."""


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder's sizes."""

    name: str
    """Shape name (SHAPES key)."""
    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size."""
    heads: int
    """Attention heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention when < heads)."""
    ffn: int
    """MLP intermediate size."""
    vocab: int = 32000
    """Vocabulary size (embedding and LM head, untied)."""

    @property
    def params(self) -> float:
        """Parameter count (norms left out)."""
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return self.layers * (attn + 3 * self.hidden * self.ffn) + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> float:
        """bf16 KV-cache bytes one token holds over all layers."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * 2


SHAPES: dict[str, ModelShape] = {
    "llama-7b": ModelShape("llama-7b", 32, 4096, 32, 32, 11008),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 40, 13824),
    "llama-34b": ModelShape("llama-34b", 48, 8192, 64, 8, 22016),
    "llama-70b": ModelShape("llama-70b", 80, 8192, 64, 8, 28672),
}
"""The Llama 2 / Code Llama sizes the HybridFlow paper evaluates."""


@dataclass(frozen=True)
class RLWorkload:
    """One RL step's data: prompts, lengths, samples per prompt."""

    prompts: int = 1024
    """Prompts per step."""
    prompt_len: int = 1024
    """Tokens per prompt."""
    response_len: int = 1024
    """Tokens generated per sample."""
    n: int = 1
    """Samples per prompt."""

    @property
    def sequences(self) -> int:
        """Sequences per step."""
        return self.prompts * self.n

    @property
    def tokens(self) -> float:
        """Prompt + response tokens of the step."""
        return self.sequences * (self.prompt_len + self.response_len)


def link_bytes_per_s(spec: GpuSpec, group: int) -> float:
    """Per-GPU bandwidth of a collective over `group` consecutive GPUs: NVLink inside a node, else the network."""
    return spec.intra_node_bytes_per_s if group <= spec.gpus_per_node else spec.inter_node_bytes_per_s


def ring_seconds(
    spec: GpuSpec, group: int, nbytes: float, calls: int = 1, all_reduce: bool = True, span: int | None = None
) -> float:
    """Seconds of `calls` ring collectives moving `nbytes` each over `group` GPUs (all-reduce: twice the
    all-gather / reduce-scatter traffic); `span`: how many consecutive GPUs the group's members are spread
    over (default `group`), which decides whether it runs over NVLink or the network."""
    if group <= 1:
        return 0.0
    factor = (2 if all_reduce else 1) * (group - 1) / group
    return calls * (spec.collective_latency_s + factor * nbytes / link_bytes_per_s(spec, span or group))


def train_seconds(shape: ModelShape, w: RLWorkload, spec: GpuSpec, dp: int, tp: int) -> float:
    """One update pass over the step's tokens on dp x tp GPUs: compute, 4 tp all-reduces per layer (2 forward,
    2 backward), and FSDP's parameter all-gathers + gradient reduce-scatter (overlapped with compute)."""
    compute = 6 * shape.params * w.tokens / (dp * tp * spec.bf16_flops * MFU_TRAIN)
    act_bytes = w.tokens / dp * shape.hidden * 2
    tp_comm = ring_seconds(spec, tp, act_bytes, calls=4 * shape.layers)
    fsdp_bytes = 3 * INFER_STATE_BYTES * shape.params / tp
    fsdp = ring_seconds(spec, dp * tp, fsdp_bytes, all_reduce=False)
    return max(compute, fsdp) + tp_comm


def forward_seconds(shape: ModelShape, w: RLWorkload, spec: GpuSpec, dp: int, tp: int) -> float:
    """One forward pass over the step's tokens (log-probs, values or rewards) on dp x tp GPUs."""
    compute = 2 * shape.params * w.tokens / (dp * tp * spec.bf16_flops * MFU_FORWARD)
    tp_comm = ring_seconds(spec, tp, w.tokens / dp * shape.hidden * 2, calls=2 * shape.layers)
    fsdp = ring_seconds(spec, dp * tp, INFER_STATE_BYTES * shape.params / tp, all_reduce=False)
    return max(compute, fsdp) + tp_comm


def generate_seconds(
    shape: ModelShape, w: RLWorkload, spec: GpuSpec, devices: int, tp: int, free_bytes: float
) -> float | None:
    """Generation of the step's responses on `devices` GPUs as devices // tp replicas of tp GPUs each:
    a compute-bound prefill, then response_len decode steps, each bound by the larger of reading the
    weight shard + KV cache and its FLOPs, plus 2 tp all-reduces per layer. Sequences that do not fit
    `free_bytes` of KV cache per GPU run in waves; None when not even one sequence fits."""
    replicas = devices // tp
    seqs = ceil(w.sequences / replicas)
    kv_per_seq = (w.prompt_len + w.response_len) * shape.kv_bytes_per_token / tp
    per_wave = int(free_bytes // kv_per_seq) if kv_per_seq > 0 else seqs
    if per_wave < 1:
        return None
    waves = ceil(seqs / per_wave)
    batch = ceil(seqs / waves)
    prefill = 2 * shape.params * seqs * w.prompt_len / (tp * spec.bf16_flops * MFU_FORWARD)
    kv_read = batch * (w.prompt_len + w.response_len / 2) * shape.kv_bytes_per_token / tp
    read_s = (INFER_STATE_BYTES * shape.params / tp + kv_read) / (spec.hbm_bytes_per_s * HBM_EFFICIENCY)
    flop_s = 2 * shape.params * batch / (tp * spec.bf16_flops * MFU_FORWARD)
    step = max(read_s, flop_s) + ring_seconds(spec, tp, batch * shape.hidden * 2, calls=2 * shape.layers)
    return prefill + waves * w.response_len * step


def reshard_seconds(shape: ModelShape, spec: GpuSpec, devices: int, tp_gen: int, hybrid_engine: bool = True) -> float:
    """The actor's train -> generate weight transition on its `devices` GPUs (training state sharded over
    all of them). 3D-HybridEngine: each rank gathers only its generation shard (bf16 params / tp_gen) from
    the devices // tp_gen ranks holding its pieces (one per generation tp group, so spread over all
    `devices`); plain: every rank all-gathers the whole model, then slices."""
    full = INFER_STATE_BYTES * shape.params
    if not hybrid_engine:
        return ring_seconds(spec, devices, full, all_reduce=False)
    return ring_seconds(spec, devices // tp_gen, full / tp_gen, all_reduce=False, span=devices)


def state_bytes(shape: ModelShape, trained: bool, dp: int, tp: int) -> float:
    """Bytes per GPU of a role's model state, sharded over dp x tp (FSDP / ZeRO-3 with tensor parallel)."""
    return shape.params * (TRAIN_STATE_BYTES if trained else INFER_STATE_BYTES) / (dp * tp)
