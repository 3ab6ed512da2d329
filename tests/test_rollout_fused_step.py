"""The fused decode step (rollout/fused_step.py, rollout/decode_step.c) against the decoder's torch path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_helpers import add_eos_bias, prompt_batch, recomputed_log_probs, tiny

import hybridflow.rollout.decoder as decoder
from hybridflow.keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.rollout import RolloutConfig, panel
from hybridflow.rollout.native import NativeRollout

needs_kernel = pytest.mark.skipif(
    panel.kernel(panel.DECODE_STEP) is None, reason="no AVX2 + FMA CPU or no C compiler here"
)
CFG = RolloutConfig(name="native", dtype="fp32", response_length=12, calculate_log_probs=True)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_steps_sample_what_the_torch_path_samples(arch, monkeypatch):
    """n samples per prompt (one prefill, repeated cache rows), rows ending early (compaction): the same tokens,
    log-probs equal to fp32 rounding, and equal to a full forward of the finished sequences."""
    model, tok = tiny(arch)
    add_eos_bias(model, tok.eos_token_id, 6.0)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(decoder, "FUSED_DECODE", fused)
        rollout = NativeRollout(replace(CFG, n=4), model, tok)
        assert (rollout._decoder().fused is not None) == fused
        runs.append(rollout.generate_sequences(prompt_batch(tok)))
    fused_out, torch_out = runs
    lengths = fused_out.batch[RESPONSE_MASK].sum(1)
    assert lengths.min() < CFG.response_length and lengths.max() > 3  # some rows ended early, some ran on
    assert torch.equal(fused_out.batch[RESPONSES], torch_out.batch[RESPONSES])
    torch.testing.assert_close(
        fused_out.batch[ROLLOUT_LOG_PROBS], torch_out.batch[ROLLOUT_LOG_PROBS], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        fused_out.batch[ROLLOUT_LOG_PROBS], recomputed_log_probs(model, fused_out), atol=1e-4, rtol=0
    )


def _prefilled(model, tok, fused: bool, weight_dtype: torch.dtype | None = None) -> decoder.StaticLlamaDecoder:
    batch = prompt_batch(tok).batch
    dec = decoder.StaticLlamaDecoder(model, fused=fused, weight_dtype=weight_dtype)
    dec.prefill(batch[INPUT_IDS], batch[ATTENTION_MASK], batch[POSITION_IDS], max_new=6)
    return dec


@needs_kernel
@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16])
def test_each_fused_step_gives_the_torch_steps_logits(weight_dtype):
    """Step by step, through a reordering with repeats (`select`), in fp32 panels and in bf16 panels."""
    model, tok = tiny("llama")
    fused, eager = _prefilled(model, tok, True, weight_dtype), _prefilled(model, tok, False, weight_dtype)
    assert fused.fused is not None and eager.fused is None
    path = "bf16_panels" if weight_dtype else "panels"
    assert {lin.path for w in fused.layers for lin in (w.qkv, w.o, w.gate_up, w.down)} == {path}
    pos = prompt_batch(tok).batch[POSITION_IDS][:, -1] + 1
    tokens = torch.tensor([5, 17, 300])
    for t in range(5):
        if t == 2:
            rows = torch.tensor([2, 0, 0])
            fused.select(rows)
            eager.select(rows)
            pos, tokens = pos[rows], tokens[rows]
        torch.testing.assert_close(fused.step(tokens, pos + t), eager.step(tokens, pos + t), atol=1e-5, rtol=1e-5)
        tokens = (tokens * 7 + 3) % 1000


def test_the_torch_path_runs_where_the_fused_step_does_not_cover_the_decoder(monkeypatch):
    model, tok = tiny("llama")
    assert _prefilled(model, tok, fused=False).fused is None
    bf16_model, _ = tiny("llama", dtype=torch.bfloat16)
    assert decoder.StaticLlamaDecoder(bf16_model).fused is None  # bf16 model: oneDNN's products
    monkeypatch.setattr(panel, "kernel", lambda *args: None)  # no AVX2 / no compiler
    dec = decoder.StaticLlamaDecoder(model)
    assert dec.fused is None and dec.layers[0].qkv.path != "panels"
