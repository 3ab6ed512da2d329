"""Batches and reference computations shared by the engine tests."""

from __future__ import annotations

import socket

import pytest
import torch
from torch.distributed.tensor import DTensor

from hybridflow.protocol import keys

VOCAB = 49152


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole: a DTensor gathered, a plain tensor (a one-rank fp32 engine's) as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def make_batch(batch: int, prompt_len: int, resp_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses with varied lengths, as in hybridflow/protocol/keys.py.

    Every prompt is shorter than `prompt_len` and every response shorter than `resp_len`,
    so whole padding columns exist at both ends (what padding removal trims).
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, prompt_len + resp_len), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(batch):
        p = int(torch.randint(1, prompt_len, (1,), generator=g))
        r = int(torch.randint(1, resp_len, (1,), generator=g))
        mask[i, prompt_len - p : prompt_len + r] = 1
    return {
        keys.INPUT_IDS: ids,
        keys.ATTENTION_MASK: mask,
        keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
        keys.RESPONSES: ids[:, prompt_len:],
    }


def reference_log_probs(model: torch.nn.Module, data: dict, temperature: float = 1.0):
    """Plain full-padding forward, full logits, fp32 log_softmax: (log_probs, entropy) [B, R]."""
    resp = data[keys.RESPONSES].shape[1]
    with torch.no_grad():
        logits = (
            model(
                input_ids=data[keys.INPUT_IDS],
                attention_mask=data[keys.ATTENTION_MASK],
                position_ids=data[keys.POSITION_IDS],
            ).logits.float()
            / temperature
        )
    logits = logits[:, -resp - 1 : -1]
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    mask = data[keys.ATTENTION_MASK][:, -resp:].bool()
    return torch.where(mask, lp, 0.0), torch.where(mask, ent, 0.0)


def make_group_batch(prompts: int, n: int, prompt_len: int, resp_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`prompts` x `n` rows as after a GRPO rollout: the n rows of a prompt share its (left-padded)
    tokens and differ in their (right-padded, varied-length) responses."""
    data = make_batch(prompts * n, prompt_len, resp_len, seed)
    ids, mask = data[keys.INPUT_IDS].clone(), data[keys.ATTENTION_MASK].clone()
    for i in range(prompts * n):
        src = (i // n) * n
        ids[i, :prompt_len], mask[i, :prompt_len] = ids[src, :prompt_len], mask[src, :prompt_len]
    return {
        keys.INPUT_IDS: ids,
        keys.ATTENTION_MASK: mask,
        keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
        keys.RESPONSES: ids[:, prompt_len:],
    }


def check_smollm2_one_step(model: torch.nn.Module, data: dict, response_len: int, results: list[dict]) -> None:
    """Each rank's {"log_probs", "metrics"} after one step of a parallel engine equals one process: its
    log-probs, the token-mean NLL of the responses (the loss) and the gradient norm of that loss."""
    want, _ = reference_log_probs(model, data)
    mask = data[keys.ATTENTION_MASK][:, -response_len:].float()
    logits = model(
        input_ids=data[keys.INPUT_IDS], attention_mask=data[keys.ATTENTION_MASK], position_ids=data[keys.POSITION_IDS]
    ).logits[:, -response_len - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    for got in results:
        torch.testing.assert_close(got["log_probs"], want, atol=1e-4, rtol=1e-4)
        assert got["metrics"]["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
        assert got["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-4)


def free_port() -> int:
    """A free TCP port on loopback for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def policy_nll_loss(global_tokens: int, dp_size: int, response_len: int):
    """Engine loss_fn: the response tokens' NLL summed over a micro-batch, scaled for a token mean over the
    whole batch (`global_tokens`) across `dp_size` data-parallel groups."""

    def fn(out, micro):
        mask = micro[keys.ATTENTION_MASK][:, -response_len:].float()
        return -(out["log_probs"] * mask).sum() / global_tokens * dp_size, {}

    return fn
