"""hf rollout: same layout and greedy output as the native rollout; log-probs; vllm on GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from rollout_helpers import add_eos_bias, prompt_batch, recomputed_log_probs, tiny

from hybridflow.protocol.keys import RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.rollout import RolloutConfig, build_rollout

R = 10


def test_hf_rollout_layout_equals_native_greedy_with_eos():
    model, tok = tiny("llama")
    add_eos_bias(model, tok.eos_token_id, 12.0)  # greedy ends some rows early
    outs = {
        name: build_rollout(
            RolloutConfig(name=name, dtype="fp32", do_sample=False, response_length=R, calculate_log_probs=True),
            model,
            tok,
        ).generate_sequences(prompt_batch(tok, step=3))
        for name in ("hf", "native")
    }
    hf, nat = outs["hf"], outs["native"]
    assert sorted(hf.batch.keys()) == sorted(nat.batch.keys())
    for key in hf.batch.keys():
        if key == ROLLOUT_LOG_PROBS:
            torch.testing.assert_close(hf.batch[key], nat.batch[key], atol=1e-4, rtol=0)
        else:
            assert torch.equal(hf.batch[key], nat.batch[key]), key
    assert hf.meta_info == nat.meta_info == {"step": 3}
    assert list(hf.non_tensor_batch["uid"]) == list(nat.non_tensor_batch["uid"])


def test_hf_rollout_samples_n_with_log_probs():
    model, tok = tiny("llama")
    cfg = RolloutConfig(
        name="hf", dtype="fp32", n=2, temperature=0.7, top_k=50, response_length=R, calculate_log_probs=True
    )
    rollout = build_rollout(cfg, model, tok)
    out = rollout.generate_sequences(prompt_batch(tok))
    assert out.batch[RESPONSES].shape == (6, R) and out.batch[RESPONSE_MASK].shape == (6, R)
    assert list(out.non_tensor_batch["uid"]) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    torch.testing.assert_close(out.batch[ROLLOUT_LOG_PROBS], recomputed_log_probs(model, out, 0.7), atol=1e-4, rtol=0)
    again = build_rollout(cfg, model, tok).generate_sequences(prompt_batch(tok))
    assert torch.equal(again.batch[RESPONSES], out.batch[RESPONSES])  # seeded


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(), reason="needs vllm and a CUDA GPU"
)
def test_vllm_rollout_greedy_layout():
    from hybridflow.models import tiny_model_dir

    model, tok = tiny("llama", dtype=torch.bfloat16)
    cfg = RolloutConfig(name="vllm", dtype="bf16", do_sample=False, response_length=R)
    rollout = build_rollout(cfg, tiny_model_dir("llama"), tok)
    out = rollout.generate_sequences(prompt_batch(tok))
    assert out.batch[RESPONSES].shape == (3, R)
    rollout.load_weights({k: v.float() for k, v in model.state_dict().items()})
