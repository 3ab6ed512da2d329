"""Shared helpers of the rollout tests: tiny models, left-padded prompt batches, reference log-probs."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol.keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES

PROMPTS = ["Hello there", "What is 12 plus 7? Answer with a number.", "The capital of France is"]


def tiny(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object]:
    """A cached tiny random model (2 layers, hidden 64) and its (SmolLM2) tokenizer."""
    path = tiny_model_dir(arch, seed=seed)
    return load_causal_lm(path, dtype=dtype).eval(), load_tokenizer(path)


def prompt_batch(tokenizer, texts: list[str] = PROMPTS, **meta) -> DataProto:
    """Left-padded prompts of different lengths with a uid per row."""
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    uids = np.array([f"p{i}" for i in range(len(texts))], dtype=object)
    return DataProto.from_dict(
        {INPUT_IDS: enc["input_ids"], ATTENTION_MASK: mask, POSITION_IDS: pos}, {"uid": uids}, dict(meta)
    )


def full_forward_logits(model: nn.Module, out: DataProto) -> Tensor:
    """fp32 logits [B, R, V] predicting each response token, from one forward of the final sequences."""
    width = out.batch[RESPONSES].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out.batch[INPUT_IDS],
            attention_mask=out.batch[ATTENTION_MASK],
            position_ids=out.batch[POSITION_IDS],
        ).logits.float()
    return logits[:, -width - 1 : -1]


def recomputed_log_probs(model: nn.Module, out: DataProto, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at each response token, 0 outside the response mask."""
    logp = (full_forward_logits(model, out) / temperature).log_softmax(-1)
    picked = logp.gather(-1, out.batch[RESPONSES][..., None]).squeeze(-1)
    return picked * out.batch[RESPONSE_MASK]


def add_eos_bias(model: nn.Module, eos_id: int, value: float) -> None:
    """Give the (bias-free) lm_head a bias that favours EOS by `value`."""
    bias = torch.zeros(model.lm_head.out_features, dtype=model.lm_head.weight.dtype)
    bias[eos_id] = value
    model.lm_head.bias = nn.Parameter(bias)


def without_bf16_products(monkeypatch) -> None:
    """Run the panel kernel without its bf16 products (`panel.DOT`), as a CPU without avx512_bf16 does."""
    from hybridflow.rollout.native import panel  # noqa: PLC0415

    if panel.kernel() is not None:
        monkeypatch.delitem(panel._kernels, panel.DOT, raising=False)
