"""Shared-prompt packing (engine/prefix.py): the n samples of a prompt run against one copy of it and
give the log-probs, entropy, values and gradients of the full-padding forward."""

from types import SimpleNamespace

import pytest
import torch

from hybridflow.engine import EngineConfig, FSDPEngine
from hybridflow.engine.prefix import pack_shared_prompts, sharing_pays
from hybridflow.models import load_causal_lm, load_value_model, tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import full, make_group_batch, reference_log_probs


def _engine(path, **kw) -> FSDPEngine:
    return FSDPEngine.from_pretrained(path, EngineConfig(param_dtype="fp32", **kw))


def test_each_prompt_is_packed_once():
    data = make_group_batch(2, 3, 7, 5, seed=0)
    packed = pack_shared_prompts(data)
    mask = data[keys.ATTENTION_MASK]
    prompt_tokens = int(mask[0, :7].sum() + mask[3, :7].sum())
    assert packed.input_ids.shape[1] == prompt_tokens + int(mask[:, 7:].sum())
    assert packed.attention_mask.shape == (1, 1, packed.input_ids.shape[1], packed.input_ids.shape[1])
    assert packed.predictors.numel() == packed.labels.numel() == int(mask[:, 7:].sum())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_match_full_padding_reference(arch, temperature):
    path = tiny_model_dir(arch)
    data = make_group_batch(3, 4, 9, 7, seed=1)
    ref_lp, ref_ent = reference_log_probs(load_causal_lm(path), data, temperature)
    engine = _engine(path, share_prompts=True, logits_chunk_size=5)
    assert sharing_pays({k: v[:5] for k, v in data.items()}, engine.hf_config())  # the shared path runs
    # micro-batches of 5 rows cut groups in two: each part shares its own copy of the prompt
    lp, ent = engine.compute_log_probs(data, micro_batch_size=5, temperature=temperature, calc_entropy=True)
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)


def test_values_match_full_padding_reference():
    path = tiny_model_dir("llama")
    data = make_group_batch(2, 3, 8, 6, seed=4)
    model = load_value_model(path)
    with torch.no_grad():
        full = model(data[keys.INPUT_IDS], data[keys.ATTENTION_MASK], data[keys.POSITION_IDS])
    expected = full[:, -7:-1] * data[keys.ATTENTION_MASK][:, -6:]
    values = FSDPEngine(model, EngineConfig(param_dtype="fp32", share_prompts=True)).compute_values(data, 6)
    torch.testing.assert_close(values, expected, atol=2e-5, rtol=1e-5)


def test_a_response_never_sees_another_response_of_its_prompt():
    data = make_group_batch(1, 4, 8, 6, seed=5)
    engine = _engine(tiny_model_dir("llama"), share_prompts=True)
    before, _ = engine.compute_log_probs(data, 4)
    ids = data[keys.INPUT_IDS].clone()
    ids[0, 8:] = 17  # rewrite the first row's response
    after, _ = engine.compute_log_probs({**data, keys.INPUT_IDS: ids, keys.RESPONSES: ids[:, 8:]}, 4)
    assert not torch.allclose(after[0], before[0])
    torch.testing.assert_close(after[1:], before[1:], atol=1e-6, rtol=0)


def test_gradients_equal_the_padded_forward():
    path = tiny_model_dir("llama")
    data = make_group_batch(2, 3, 8, 6, seed=6)
    weights = torch.randn(data[keys.RESPONSES].shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for share in (False, True):
        engine = _engine(path, share_prompts=share, use_remove_padding=False)
        engine.module.train()
        out = engine.forward_micro_batch(data)
        (out["log_probs"] * weights).sum().backward()
        grads.append({n: full(p.grad) for n, p in engine.module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)


def test_sharing_is_chosen_by_estimated_flops():
    smollm2 = SimpleNamespace(
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_key_value_heads=3,
        num_attention_heads=9,
        head_dim=64,
    )
    # the main job's shape: 2 prompts of 45 tokens x 8 samples of <= 23 tokens: sharing pays
    assert sharing_pays(make_group_batch(2, 8, 46, 24, seed=7), smollm2)
    # 16 different unpadded 150 + 20-token rows: one dense 2720-token row would cost more than 16 rows
    ids = torch.randint(0, 100, (16, 170))
    unique = {keys.INPUT_IDS: ids, keys.ATTENTION_MASK: torch.ones_like(ids), keys.RESPONSES: ids[:, 150:]}
    assert not sharing_pays(unique, smollm2, dense_attention=True)
    # no prompt is shared: the trimmed rows stay, although a packed row would cost less here (packing's choice)
    assert not sharing_pays(unique, smollm2)
    # 32 prompts x 4 samples of 64 + 32 tokens: dense over its 6144 tokens (37.7M pairs) the row costs more
    # than the 128 rows of 96 (12288 tokens, 1.2M pairs); over its 0.5M visible pairs it costs less
    groups = make_group_batch(32, 4, 64, 32, seed=8)
    groups[keys.ATTENTION_MASK][:] = 1
    assert not sharing_pays(groups, smollm2, dense_attention=True)
    assert sharing_pays(groups, smollm2)
