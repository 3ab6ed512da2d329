"""The Tinker service's training forward (hybridflow/service/forward.py) against the plain one.

The shared-prompt pass and the head on chosen tokens are layouts, not approximations: on a tiny llama with a LoRA
adapter they must give every datum's log-probs and the adapter's gradients of a loss as one padded forward of the
whole model with autograd everywhere does. A model whose logits are not head(decoder(...)) (Gemma-2's softcap)
must be found and get the model's own forward.
"""

from __future__ import annotations

import numpy as np
import peft
import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import Gemma2Config, Gemma2ForCausalLM

from hybridflow.engine.config import LoraConfig
from hybridflow.engine.lora import peft_config
from hybridflow.models import load_causal_lm, tiny_model_dir
from hybridflow.service.forward import SharedPrompts, batch_parts, head_splits, length_buckets, target_logprobs
from hybridflow.service.wire import Datum

VOCAB = 49152


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir("llama"), dtype=torch.float32)
    cfg = peft_config(LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"]))
    wrapped = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # B = 0 at init would make the adapter's output (and half its gradients) trivial
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return wrapped.get_base_model()


def batch(seed: int = 0) -> tuple[list[Datum], list[torch.Tensor]]:
    """3 prompts of different lengths, 3 samples each (one sample of prompt 1 has all-zero advantages, so its
    split falls at its last token; prompt 2's samples are 20 tokens longer, so the continuations run in more than
    one length bucket), and one datum of its own; advantages on the sampled tokens only."""
    rng = np.random.default_rng(seed)
    data, advantages = [], []
    for g, plen in enumerate((7, 11, 5, 9)):
        prompt = rng.integers(0, VOCAB, plen)
        for s in range(3 if g < 3 else 1):
            tokens = np.concatenate([prompt, rng.integers(0, VOCAB, 2 + (g + s) % 4 + (20 if g == 2 else 0))])
            adv = np.zeros(len(tokens) - 1, np.float32)
            if not (g == 1 and s == 2):
                adv[plen - 1 :] = rng.normal(size=len(tokens) - plen)
            data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "advantages": adv}))
            advantages.append(torch.from_numpy(adv))
    return data, advantages


def reference_logprobs(lm, data: list[Datum]) -> list[torch.Tensor]:
    """One right-padded forward of the whole model, log-softmax over every position."""
    rows = [torch.from_numpy(d.tokens) for d in data]
    ids = pad_sequence(rows, batch_first=True)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    logps = torch.log_softmax(lm(input_ids=ids, attention_mask=mask).logits.float(), -1)
    return [
        logps[r, : len(d.tokens)].gather(-1, torch.from_numpy(d.inputs["target_tokens"])[:, None])[:, 0]
        for r, d in enumerate(data)
    ]


def loss_and_grads(lm, logps: list[torch.Tensor], advantages: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    params = [p for p in lm.parameters() if p.requires_grad]
    loss = -sum((lp * a).sum() for lp, a in zip(logps, advantages))
    return float(loss.detach()), list(torch.autograd.grad(loss, params))


def test_the_plan_shares_each_prompt_once():
    data, advantages = batch()
    plan = SharedPrompts.plan(data, [a != 0 for a in advantages])
    assert plan is not None
    # prompts 0, 2, 3 once each; prompt 1 once for its two trained samples, and the untrained sample is its own
    assert len(plan.prompts) == 5 and plan.group == [0, 0, 0, 1, 1, 2, 3, 3, 3, 4]
    assert plan.splits[:3] == [6, 6, 6] and plan.splits[5] == len(data[5].tokens) - 1
    # nothing shared (each datum alone) or a differentiated first token: no plan, the padded pass runs
    assert SharedPrompts.plan(data[::3], [a != 0 for a in advantages[::3]]) is None
    first = [torch.ones(len(d.tokens), dtype=torch.bool) for d in data]
    assert SharedPrompts.plan(data, first) is None


def test_shared_prompts_and_chosen_tokens_equal_the_plain_forward(lm):
    data, advantages = batch()
    marks = [a != 0 for a in advantages]
    want = reference_logprobs(lm, data)
    want_loss, want_grads = loss_and_grads(lm, want, advantages)
    got = target_logprobs(lm, data, marks)
    plan = SharedPrompts.plan(data, marks)
    assert plan is not None  # the shared path is the one measured here, in more than one continuation pass
    assert len(length_buckets([len(d.tokens) - k for d, k in zip(data, plan.splits)])) > 1
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w.detach(), rtol=1e-5, atol=1e-5)
        assert g.requires_grad
    got_loss, got_grads = loss_and_grads(lm, got, advantages)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-5)
    assert any(g.abs().sum() > 0 for g in want_grads)
    for w, g in zip(want_grads, got_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_unmarked_tokens_carry_no_gradient_and_forward_only_none(lm):
    data, advantages = batch(1)
    marks = [a != 0 for a in advantages]
    got = target_logprobs(lm, data, marks)
    probe = sum((lp * (~m).float()).sum() for lp, m in zip(got, marks))  # only the unmarked tokens
    params = [p for p in lm.parameters() if p.requires_grad]
    grads = torch.autograd.grad(probe, params, allow_unused=True)
    assert all(g is None or not g.any() for g in grads)
    with torch.no_grad():
        plain = target_logprobs(lm, data)
    assert not any(lp.requires_grad for lp in plain)
    for p, g in zip(plain, got):
        torch.testing.assert_close(p, g.detach(), rtol=1e-5, atol=1e-5)


def test_a_softcapped_head_is_found_and_gets_the_full_forward():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,
    )
    gemma = Gemma2ForCausalLM(config).eval()
    assert not head_splits(gemma)
    data = [Datum(np.arange(1, 6), {"target_tokens": np.arange(2, 7)})]
    want = torch.log_softmax(gemma(input_ids=torch.arange(1, 6)[None]).logits[0].float(), -1)
    got = target_logprobs(gemma, data, split_head=False)[0]
    torch.testing.assert_close(got, want.gather(-1, torch.arange(2, 7)[:, None])[:, 0], rtol=1e-5, atol=1e-5)


def test_head_splits_on_a_llama(lm):
    assert head_splits(lm)


def test_batch_parts_keep_each_part_within_the_budget():
    data = [Datum(np.zeros(n, np.int64), {}) for n in (10, 30, 5, 40, 20, 2)]
    parts = batch_parts(data, budget=64)
    assert [len(p) for p in parts] == [2, 1, 1, 2]
    assert all(len(p) * max(len(d.tokens) for d in p) <= 64 for p in parts)


def test_length_buckets_pad_least():
    assert length_buckets([3, 30, 4, 29, 3], pass_cost=8) == [[0, 4, 2], [3, 1]]
    assert length_buckets([3, 30, 4, 29, 3], pass_cost=1000) == [[0, 4, 2, 3, 1]]  # a pass dearer than padding
    assert length_buckets([5], pass_cost=8) == [[0]] and length_buckets([]) == []
