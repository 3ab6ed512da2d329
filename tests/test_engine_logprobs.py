"""Engine forward: log-probs, entropy and values with padding removed (trimmed or packed) equal a
full-padding reference, and packed examples never attend to each other."""

import pytest
import torch

from hybridflow.engine import EngineConfig, FSDPEngine
from hybridflow.models import load_causal_lm, load_value_model, tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import make_batch, reference_log_probs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


def _engine(path, **kw) -> FSDPEngine:
    return FSDPEngine.from_pretrained(path, EngineConfig(param_dtype="fp32", **kw))


@pytest.mark.parametrize("packing", [False, True], ids=["trimmed", "packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_match_full_padding_reference(arch, temperature, packing):
    path = tiny_model_dir(arch)
    data = make_batch(6, 9, 7, seed=1)
    ref_lp, ref_ent = reference_log_probs(load_causal_lm(path), data, temperature)
    engine = _engine(path, use_remove_padding=True, logits_chunk_size=5, packing=packing)
    lp, ent = engine.compute_log_probs(data, micro_batch_size=4, temperature=temperature, calc_entropy=True)
    assert lp.shape == ent.shape == data[keys.RESPONSES].shape
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
    assert (lp[data[keys.ATTENTION_MASK][:, -7:] == 0] == 0).all()


def test_padding_removal_on_and_off_agree():
    path = tiny_model_dir("llama")
    data = make_batch(5, 8, 6, seed=2)
    on, _ = _engine(path, use_remove_padding=True).compute_log_probs(data, 2)
    off, _ = _engine(path, use_remove_padding=False).compute_log_probs(data, 5)
    torch.testing.assert_close(on, off, atol=2e-5, rtol=1e-5)


def test_bf16_compute_is_close_to_fp32():
    path = tiny_model_dir("llama")
    data = make_batch(4, 8, 6, seed=3)
    ref, _ = reference_log_probs(load_causal_lm(path), data)
    lp, _ = FSDPEngine.from_pretrained(path, EngineConfig(param_dtype="bf16")).compute_log_probs(data, 4)
    assert (lp - ref).abs().max() < 0.1


@pytest.mark.parametrize("packing", [False, True], ids=["trimmed", "packed"])
def test_values_align_with_responses(packing):
    path = tiny_model_dir("llama")
    data = make_batch(4, 8, 6, seed=4)
    model = load_value_model(path)
    with torch.no_grad():
        full = model(data[keys.INPUT_IDS], data[keys.ATTENTION_MASK], data[keys.POSITION_IDS])
    expected = full[:, -7:-1] * data[keys.ATTENTION_MASK][:, -6:]
    engine = FSDPEngine(model, EngineConfig(param_dtype="fp32", packing=packing))
    values = engine.compute_values(data, micro_batch_size=3)
    torch.testing.assert_close(values, expected, atol=2e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="causal LM"):
        engine.compute_log_probs(data, 2)


def test_packed_examples_do_not_attend_to_each_other():
    data = make_batch(4, 8, 6, seed=5)
    engine = _engine(tiny_model_dir("llama"), packing=True)
    before, _ = engine.compute_log_probs(data, 4)
    ids = data[keys.INPUT_IDS].clone()
    ids[0][data[keys.ATTENTION_MASK][0].bool()] = 17  # rewrite every token of the first example
    changed = {**data, keys.INPUT_IDS: ids, keys.RESPONSES: ids[:, -6:]}
    after, _ = engine.compute_log_probs(changed, 4)
    assert not torch.allclose(after[0], before[0])
    torch.testing.assert_close(after[1:], before[1:], atol=1e-6, rtol=0)  # the other examples: untouched
