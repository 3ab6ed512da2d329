"""The fused decode step (rollout/native/fused_step.py, rollout/native/decode_step.c) against the decoder's torch path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_helpers import add_eos_bias, prompt_batch, recomputed_log_probs, tiny, without_bf16_products

import hybridflow.rollout.native.decoder as decoder
from hybridflow.protocol.keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from hybridflow.rollout import RolloutConfig
from hybridflow.rollout.native import panel
from hybridflow.rollout.native.rollout import NativeRollout

needs_kernel = pytest.mark.skipif(
    panel.kernel(panel.DECODE_STEP) is None, reason="no AVX2 + FMA CPU or no C compiler here"
)
needs_dot = pytest.mark.skipif(panel.kernel(panel.DOT) is None, reason="no avx512_bf16 CPU (or compiler) here")
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
@pytest.mark.parametrize(
    "weight_dtype, model_dtype",
    [(None, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["panels", "bf16_panels", "bf16_dot"],
)
def test_each_fused_step_gives_the_torch_steps_logits(weight_dtype, model_dtype):
    """Step by step, through a reordering with repeats (`select`), in fp32 panels, in bf16 panels and (a bf16
    model where the CPU has bf16 products) in bf16 panels of column pairs."""
    model, tok = tiny("llama", dtype=model_dtype)
    fused, eager = _prefilled(model, tok, True, weight_dtype), _prefilled(model, tok, False, weight_dtype)
    assert fused.fused is not None and eager.fused is None
    path = "bf16_panels" if weight_dtype else "panels"
    if model_dtype == torch.bfloat16:
        if panel.kernel(panel.DOT) is None:
            pytest.skip("no avx512_bf16 CPU (or compiler) here")
        path = "bf16_dot"
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


@needs_kernel
def test_a_bf16_model_on_bf16_panels_decodes_as_its_fp32_copy_does(monkeypatch):
    """A bf16 model's own weights in bf16 panels, fp32 math (a CPU without bf16 products): the same logits, bit for
    bit, as the fp32 model holding the same (bf16-representable) weights with rollout.weight_dtype=bf16, through
    prefill and fused steps."""
    without_bf16_products(monkeypatch)
    bf16_model, tok = tiny("qwen2", dtype=torch.bfloat16)  # qwen2: q/k/v biases, widened to fp32 for the kernel
    fp32_model, _ = tiny("qwen2", dtype=torch.bfloat16)
    fp32_model.float()
    on_bf16, on_fp32 = (_prefilled(m, tok, True, torch.bfloat16) for m in (bf16_model, fp32_model))
    assert on_bf16.fused is not None and on_bf16.dtype == on_bf16.k_cache.dtype == torch.float32
    pos = prompt_batch(tok).batch[POSITION_IDS][:, -1] + 1
    tokens = torch.tensor([5, 17, 300])
    for t in range(4):
        a, b = on_bf16.step(tokens, pos + t), on_fp32.step(tokens, pos + t)
        assert a.dtype == torch.float32 and torch.equal(a, b)
        tokens = a.argmax(-1)


@needs_kernel
def test_a_bf16_rollout_takes_bf16_panels_at_a_few_rows_only(monkeypatch):
    """Without bf16 products, up to BF16_PANEL_MAX_ROWS rows (prompts x n) a bf16 rollout samples on the fused fp32
    step over its bf16 weights, the same tokens as an fp32 copy with rollout.weight_dtype=bf16; more rows keep
    oneDNN's bf16 path."""
    import hybridflow.rollout.native.rollout as native

    without_bf16_products(monkeypatch)
    bf16_model, tok = tiny("llama", dtype=torch.bfloat16)
    rollout = NativeRollout(replace(CFG, dtype="bf16", n=2), bf16_model, tok)
    small, large = rollout._decoder(native.BF16_PANEL_MAX_ROWS), rollout._decoder(native.BF16_PANEL_MAX_ROWS + 1)
    assert small.fused is not None and small.dtype == torch.float32
    assert large.fused is None and large.dtype == torch.bfloat16 and large.layers[0].qkv.path != "bf16_panels"
    fp32_model, _ = tiny("llama", dtype=torch.bfloat16)
    reference = NativeRollout(replace(CFG, n=2, weight_dtype="bf16"), fp32_model.float(), tok)
    out, ref = rollout.generate_sequences(prompt_batch(tok)), reference.generate_sequences(prompt_batch(tok))
    assert torch.equal(out.batch[RESPONSES], ref.batch[RESPONSES])
    assert torch.equal(out.batch[ROLLOUT_LOG_PROBS], ref.batch[ROLLOUT_LOG_PROBS])
    monkeypatch.setattr(decoder, "FUSED_DECODE", False)  # without the fused step the bf16 products stay faster
    assert rollout._decoder(2).dtype == torch.bfloat16


@needs_dot
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_a_bf16_rollout_runs_bf16_products_at_any_rows(arch):
    """Where the CPU has bf16 products a bf16 rollout decodes in the fused step on them at any number of rows; its
    log-probs are the bf16 model's own forward's to bf16 precision, and nearer the fp32 copy's than that forward."""
    import hybridflow.rollout.native.rollout as native

    model, tok = tiny(arch, dtype=torch.bfloat16)
    add_eos_bias(model, tok.eos_token_id, 6.0)
    rollout = NativeRollout(replace(CFG, dtype="bf16", n=4), model, tok)
    for rows in (1, native.BF16_PANEL_MAX_ROWS + 1, 256):
        dec = rollout._decoder(rows)
        assert dec.fused is not None and dec.fused.kind == 2 and dec.dtype == torch.float32
    out = rollout.generate_sequences(prompt_batch(tok))
    assert out.batch[RESPONSE_MASK].sum() > 12
    mine, bf16_forward = out.batch[ROLLOUT_LOG_PROBS], recomputed_log_probs(model, out)
    fp32_forward = recomputed_log_probs(model.float(), out)
    torch.testing.assert_close(mine, bf16_forward, atol=0.01, rtol=0)
    assert (mine - fp32_forward).abs().mean() < (bf16_forward - fp32_forward).abs().mean()
