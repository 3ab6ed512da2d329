"""Attention over the shared-prompt row's visible pairs only (engine/prefix_attention.py): the same outputs and
gradients as the dense masked product, and the engine runs it where it shares prompts."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import hybridflow.engine.prefix_attention as prefix_attention_module
from hybridflow.engine import EngineConfig, FSDPEngine
from hybridflow.engine.prefix import pack_shared_prompts
from hybridflow.engine.prefix_attention import ATTENTION_NAME, LAYOUT_KWARG, build_layout, prefix_attention
from hybridflow.models import load_causal_lm, tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import full, make_group_batch


def test_layout_by_hand():
    # [P0 P0 P0][A A][B][P1][C C C]: prompt 0 (3 tokens) with responses A (2) and B (1), prompt 1 (1) with C (3)
    layout = build_layout([(0, 3), (6, 1)], [(3, 2, 0), (5, 1, 0), (7, 3, 1)])
    assert layout.prompt.tolist() == [[0, 1, 2], [6, 6, 6]]
    assert layout.resp_q.tolist() == [[3, 4, 4], [5, 5, 5], [7, 8, 9]]
    assert layout.resp_kv.tolist() == [[0, 1, 2, 3, 4, 4], [0, 1, 2, 5, 5, 5], [6, 6, 6, 7, 8, 9]]
    # response C's second token sees prompt 1's one token and C's first two tokens
    assert layout.resp_mask[2, 0, 1].tolist() == [True, False, False, True, True, False]
    # response B's padding query rows still see the prompt (no empty softmax) and B's one token
    assert layout.resp_mask[1, 0, 2].tolist() == [True, True, True, True, False, False]
    # outputs: prompts flattened (6 rows), then responses (9 rows); column 4 is A's 2nd token = row 6 + 1
    assert layout.order.tolist() == [0, 1, 2, 6, 7, 9, 3, 12, 13, 14]


def _qkv(n: int, heads: int, kv_heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = lambda h: (1, h, n, 8)  # noqa: E731
    return [torch.randn(shape(h), generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_equals_the_dense_masked_product_forward_and_backward(kv_heads):
    data = make_group_batch(3, 4, 9, 7, seed=3)  # varied prompt and response lengths, some left padding
    packed = pack_shared_prompts(data)
    n = packed.input_ids.shape[1]
    module = SimpleNamespace(num_key_value_groups=4 // kv_heads)
    q, k, v = _qkv(n, 4, kv_heads, seed=0)
    out, _ = prefix_attention(module, q, k, v, None, scaling=0.3, **{LAYOUT_KWARG: packed.prefix})
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=packed.attention_mask, scale=0.3, enable_gqa=kv_heads < 4
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = [torch.autograd.grad((o * weights).sum(), (q, k, v)) for o in (out, want)]
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_without_a_layout_it_is_sdpa():
    q, k, v = _qkv(6, 4, 4, seed=2)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    out, _ = prefix_attention(SimpleNamespace(num_key_value_groups=1), q, k, v, mask, scaling=0.5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_an_empty_response_row_is_skipped():
    data = make_group_batch(2, 3, 6, 5, seed=4)
    data[keys.ATTENTION_MASK][1, 6:] = 0  # row 1 generated nothing
    packed = pack_shared_prompts(data)
    assert packed.prefix.resp_q.shape[0] == 5
    q, k, v = _qkv(packed.input_ids.shape[1], 2, 2, seed=5)
    out, _ = prefix_attention(SimpleNamespace(num_key_value_groups=1), q, k, v, None, **{LAYOUT_KWARG: packed.prefix})
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.attention_mask).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_engine_runs_it_and_matches_the_dense_engine(checkpointing, monkeypatch):
    """Same log-probs and gradients as the engine whose model keeps transformers' SDPA over the [N, N] mask;
    the layout reaches every layer's attention, with activation checkpointing too."""
    path = tiny_model_dir("llama")
    data = make_group_batch(2, 4, 8, 6, seed=6)
    weights = torch.randn(data[keys.RESPONSES].shape, generator=torch.Generator().manual_seed(0))
    calls = []
    real = prefix_attention_module._take
    monkeypatch.setattr(prefix_attention_module, "_take", lambda x, i: calls.append(1) or real(x, i))
    results = []
    for prefix in (True, False):
        engine = FSDPEngine.from_pretrained(
            path, EngineConfig(param_dtype="fp32", share_prompts=True, gradient_checkpointing=checkpointing)
        )
        assert engine.module.config._attn_implementation == ATTENTION_NAME
        if not prefix:
            engine.module.set_attn_implementation("sdpa")  # ignores the layout: the dense masked product
        engine.module.train()
        out = engine.forward_micro_batch(data)
        (out["log_probs"] * weights).sum().backward()
        results.append((out["log_probs"].detach(), {n: full(p.grad) for n, p in engine.module.named_parameters()}))
        if prefix:
            layers = engine.module.config.num_hidden_layers
            assert len(calls) == 6 * layers * (2 if checkpointing else 1)  # q, k, v for prompts and responses
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    for name, grad in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_generation_is_unchanged():
    path = tiny_model_dir("qwen2")
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(7))
    outs = []
    for name in ("sdpa", ATTENTION_NAME):
        model = load_causal_lm(path)
        model.set_attn_implementation(name)
        outs.append(model.generate(ids, max_new_tokens=6, do_sample=False))
    assert torch.equal(outs[0], outs[1])
