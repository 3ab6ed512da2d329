"""Native rollout against transformers: greedy equality, sampling filters, n samples, EOS, log-probs."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from rollout_helpers import add_eos_bias, full_forward_logits, prompt_batch, recomputed_log_probs, tiny

from hybridflow.protocol.keys import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.config import SamplingParams
from hybridflow.rollout.layout import pad_responses
from hybridflow.rollout.native import decoder as decoder_module
from hybridflow.rollout.native.rollout import NativeRollout

R = 12


def native(model, tok, use_static: bool | None = None, **kw) -> NativeRollout:
    cfg = RolloutConfig(name="native", dtype="fp32", response_length=kw.pop("response_length", R), **kw)
    return NativeRollout(cfg, model, tok, use_static=use_static)


def hf_greedy(model, tok, batch, width: int = R) -> torch.Tensor:
    ids, mask = batch.batch[INPUT_IDS], batch.batch[ATTENTION_MASK]
    with torch.no_grad():
        seqs = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=width,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return pad_responses(seqs[:, ids.shape[1] :], width, tok.pad_token_id)


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


@pytest.mark.parametrize("arch,use_static", [("llama", True), ("llama", False), ("qwen2", True)])
def test_greedy_matches_transformers_generate(arch, use_static):
    model, tok = tiny(arch)
    batch = prompt_batch(tok)
    assert batch.batch[ATTENTION_MASK].sum(1).unique().numel() == 3  # three prompt lengths
    out = native(model, tok, use_static, do_sample=False).generate_sequences(batch)
    assert torch.equal(out.batch[RESPONSES], hf_greedy(model, tok, batch))
    assert out.batch[RESPONSE_MASK].all()


def test_greedy_with_early_eos_matches_transformers():
    model, tok = tiny("llama")
    batch = prompt_batch(tok)
    free = native(model, tok, do_sample=False).generate_sequences(batch)
    logits = full_forward_logits(model, free)
    gaps = logits.max(-1).values - logits[..., tok.eos_token_id]
    add_eos_bias(model, tok.eos_token_id, float(gaps[0, 3]) + 1e-3)  # row 0 ends by step 3
    out = native(model, tok, do_sample=False).generate_sequences(batch)
    lengths = out.batch[RESPONSE_MASK].sum(1)
    assert lengths[0] <= 4 and lengths.min() < R
    assert torch.equal(out.batch[RESPONSES], hf_greedy(model, tok, batch))


def test_top_k_one_is_greedy_and_call_params_override_the_config(llama):
    model, tok = llama
    greedy = native(model, tok, do_sample=False).generate_sequences(prompt_batch(tok))
    top1 = native(model, tok, top_k=1, temperature=0.7).generate_sequences(prompt_batch(tok))
    assert torch.equal(top1.batch[RESPONSES], greedy.batch[RESPONSES])
    call_greedy = native(model, tok).generate_sequences(prompt_batch(tok), SamplingParams(do_sample=False))
    assert torch.equal(call_greedy.batch[RESPONSES], greedy.batch[RESPONSES])
    call_k1 = native(model, tok).generate_sequences(prompt_batch(tok), SamplingParams(top_k=1))
    assert torch.equal(call_k1.batch[RESPONSES], greedy.batch[RESPONSES])
    rollout = native(model, tok, n=2)
    validate = rollout.generate_sequences(prompt_batch(tok), rollout.config.sampling_params(validate=True))
    assert torch.equal(validate.batch[RESPONSES], greedy.batch[RESPONSES])  # val_kwargs: greedy, n=1


def test_sampled_tokens_respect_top_k(llama):
    model, tok = llama
    out = native(model, tok, top_k=5, temperature=2.0).generate_sequences(prompt_batch(tok))
    top5 = full_forward_logits(model, out).topk(5, dim=-1).indices
    assert (top5 == out.batch[RESPONSES][..., None]).any(-1).all()


def test_sampled_tokens_respect_top_p(llama):
    model, tok = llama
    out = native(model, tok, top_p=0.02).generate_sequences(prompt_batch(tok))
    probs = full_forward_logits(model, out).softmax(-1)
    chosen = probs.gather(-1, out.batch[RESPONSES][..., None])
    mass_above = (probs * (probs > chosen)).sum(-1)  # mass of strictly more likely tokens
    assert (mass_above < 0.02 + 1e-5).all()
    assert out.batch[RESPONSES].unique().numel() > 3  # the nucleus is wider than one token here


def test_n_samples_layout_and_non_tensor_repeat(llama):
    model, tok = llama
    batch = prompt_batch(tok)
    out = native(model, tok, n=3, calculate_log_probs=True).generate_sequences(batch)
    b, p = batch.batch[INPUT_IDS].shape
    assert len(out) == 3 * b
    assert list(out.non_tensor_batch["uid"]) == [u for u in batch.non_tensor_batch["uid"] for _ in range(3)]
    assert torch.equal(out.batch[PROMPTS], batch.batch[INPUT_IDS].repeat_interleave(3, 0))
    assert out.batch[RESPONSES].shape == (3 * b, R) and out.batch[ROLLOUT_LOG_PROBS].shape == (3 * b, R)
    assert torch.equal(out.batch[INPUT_IDS], torch.cat([out.batch[PROMPTS], out.batch[RESPONSES]], 1))
    pos = out.batch[POSITION_IDS]
    assert torch.equal(pos[:, p:], pos[:, p - 1 : p] + torch.arange(1, R + 1))
    assert not torch.equal(out.batch[RESPONSES][0], out.batch[RESPONSES][1])  # samples of one prompt differ
    again = native(model, tok, n=3, calculate_log_probs=True).generate_sequences(batch)
    assert torch.equal(again.batch[RESPONSES], out.batch[RESPONSES])  # same seed, same samples


def test_eos_stops_rows_and_pads():
    model, tok = tiny("llama")
    eos = tok.eos_token_id
    add_eos_bias(model, eos, 10.0)  # P(EOS) about 0.3 per step
    out = native(model, tok, n=4, calculate_log_probs=True).generate_sequences(prompt_batch(tok))
    resp, mask = out.batch[RESPONSES], out.batch[RESPONSE_MASK]
    lengths = mask.sum(1)
    assert lengths.min() < R and lengths.unique().numel() > 2  # rows stop at different steps
    for row, n in zip(resp, lengths.tolist()):
        assert eos not in row[: n - 1].tolist()
        assert n == R or row[n - 1] == eos
        assert (row[n:] == tok.pad_token_id).all()
    assert torch.equal(mask.bool(), torch.arange(R)[None] < lengths[:, None])
    assert torch.equal(out.batch[ATTENTION_MASK][:, -R:], mask)
    # rows were compacted mid-loop: the log-probs still belong to the right rows
    torch.testing.assert_close(out.batch[ROLLOUT_LOG_PROBS], recomputed_log_probs(model, out), atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_rollout_log_probs_match_full_forward(llama, temperature):
    model, tok = llama
    rollout = native(model, tok, calculate_log_probs=True, temperature=temperature, n=2)
    out = rollout.generate_sequences(prompt_batch(tok))
    expect = recomputed_log_probs(model, out, temperature)
    torch.testing.assert_close(out.batch[ROLLOUT_LOG_PROBS], expect, atol=1e-4, rtol=0)
    hot = rollout.generate_sequences(prompt_batch(tok), SamplingParams(temperature=1.5, n=1))
    assert len(hot) == 3
    torch.testing.assert_close(hot.batch[ROLLOUT_LOG_PROBS], recomputed_log_probs(model, hot, 1.5), atol=1e-4, rtol=0)


def test_chunking_by_max_batch_size_keeps_results(llama):
    model, tok = llama
    whole = native(model, tok, do_sample=False).generate_sequences(prompt_batch(tok))
    chunked = native(model, tok, do_sample=False, max_batch_size=2).generate_sequences(prompt_batch(tok))
    assert torch.equal(whole.batch[RESPONSES], chunked.batch[RESPONSES])


def test_build_rollout_from_path_in_bf16():
    from hybridflow.models import tiny_model_dir

    model, tok = tiny("llama")
    cfg = RolloutConfig(name="native", dtype="bf16", response_length=4, n=2)
    rollout = build_rollout(cfg, tiny_model_dir("llama"), tok)
    assert next(rollout.model.parameters()).dtype == torch.bfloat16
    out = rollout.generate_sequences(prompt_batch(tok))
    assert out.batch[RESPONSES].shape == (6, 4)
    with pytest.raises(ValueError, match="rollout.dtype"):
        build_rollout(cfg, model, tok)  # an fp32 module with a bf16 config
    with pytest.raises(ValueError, match="rollout.prompt_length"):
        build_rollout(RolloutConfig(prompt_length=2, dtype="fp32"), model, tok).generate_sequences(prompt_batch(tok))


def test_decode_over_whole_cache_equals_decode_over_filled_slice(monkeypatch):
    """Decode attends over the whole preallocated cache (unwritten slots masked) or SDPA over the filled
    slice; with rows ending early (compaction re-allocates the cache) both give the same samples."""
    import hybridflow.rollout.native.decoder as decoder

    model, tok = tiny("llama")
    add_eos_bias(model, tok.eos_token_id, 10.0)
    monkeypatch.setattr(decoder, "FUSED_DECODE", False)  # the torch path's attention (the fused step's: its own test)
    runs = []
    for limit in (decoder.FULL_CACHE_DECODE_MAX_LEN, 0):
        monkeypatch.setattr(decoder, "FULL_CACHE_DECODE_MAX_LEN", limit)
        runs.append(native(model, tok, n=4, calculate_log_probs=True).generate_sequences(prompt_batch(tok)))
    whole, sliced = runs
    assert whole.batch[RESPONSE_MASK].sum(1).min() < R  # some rows ended early
    assert torch.equal(whole.batch[RESPONSES], sliced.batch[RESPONSES])
    torch.testing.assert_close(whole.batch[ROLLOUT_LOG_PROBS], sliced.batch[ROLLOUT_LOG_PROBS], atol=1e-5, rtol=0)


def test_bf16_decode_with_onednn_packed_weights_is_bit_identical(monkeypatch):
    import hybridflow.rollout.native.decoder as decoder
    import hybridflow.rollout.native.linear as linear

    model, tok = tiny("llama", dtype=torch.bfloat16)
    monkeypatch.setattr(
        decoder, "FUSED_DECODE", False
    )  # else a few rows decode on bf16 panels (rollout/native/rollout.py)
    probe = decoder.StaticLlamaDecoder(model)
    if probe.layers[0].qkv.packed is None:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    cfg = RolloutConfig(name="native", dtype="bf16", do_sample=False, response_length=R, calculate_log_probs=True)
    packed = NativeRollout(cfg, model, tok).generate_sequences(prompt_batch(tok))
    monkeypatch.setattr(linear, "_choose", lambda *args: "plain")
    plain = NativeRollout(cfg, model, tok).generate_sequences(prompt_batch(tok))
    assert decoder.StaticLlamaDecoder(model).layers[0].qkv.packed is None
    assert torch.equal(packed.batch[RESPONSES], plain.batch[RESPONSES])
    assert torch.equal(packed.batch[ROLLOUT_LOG_PROBS], plain.batch[ROLLOUT_LOG_PROBS])


@pytest.mark.parametrize("path", ["packed", "panels"])
def test_fp32_decode_with_laid_out_weights_matches_plain(monkeypatch, path):
    """fp32 lays a shape out only where this process timed that faster; forced to oneDNN's packed layout or to
    the AVX2 panel kernel, greedy tokens are the same as with F.linear and log-probs equal up to summation order."""
    import hybridflow.rollout.native.decoder as decoder
    import hybridflow.rollout.native.linear as linear

    model, tok = tiny("llama")
    monkeypatch.setattr(decoder, "FUSED_DECODE", False)  # else the layers take panels whatever `_choose` says
    monkeypatch.setattr(linear, "_choose", lambda *args: path)
    if path not in linear._usable_paths(model.lm_head.weight):
        pytest.skip(f"no {path} path here (no oneDNN linear, or no AVX2 / C compiler for the panel kernel)")
    assert getattr(decoder.StaticLlamaDecoder(model).lm_head, path) is not None
    cfg = RolloutConfig(name="native", dtype="fp32", do_sample=False, response_length=R, calculate_log_probs=True)
    laid_out = NativeRollout(cfg, model, tok).generate_sequences(prompt_batch(tok))
    monkeypatch.setattr(linear, "_choose", lambda *args: "plain")
    assert decoder.StaticLlamaDecoder(model).lm_head.weight is not None
    plain = NativeRollout(cfg, model, tok).generate_sequences(prompt_batch(tok))
    assert torch.equal(laid_out.batch[RESPONSES], plain.batch[RESPONSES])
    torch.testing.assert_close(laid_out.batch[ROLLOUT_LOG_PROBS], plain.batch[ROLLOUT_LOG_PROBS], atol=1e-5, rtol=0)


def test_the_fp32_layout_is_timed_once_per_shape(monkeypatch):
    import hybridflow.rollout.native.linear as linear

    monkeypatch.setattr(linear, "_FASTEST", {})
    w = torch.randn(48, 32)
    first, usable = linear._choose(w, 8), linear._usable_paths(w)
    key = (48, 32, 8, *usable)
    assert first in usable and linear._FASTEST == {key: first}
    linear._FASTEST[key] = "elsewhere"  # a cached answer is not re-measured
    assert linear._choose(w, 8) == "elsewhere"
    monkeypatch.setattr(linear.panel, "kernel", lambda *args: None)  # ... unless a path it chose cannot run now
    assert linear._choose(w, 8) != "panels"


@pytest.mark.slow  # inductor compiles C++ on first use: 25-50 s on 2 cores for an opt-in path that does not pay yet
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_kernels_decode_like_eager(arch):
    """rollout.enforce_eager=False: torch.compile'd RMSNorm / rotary / SwiGLU. Greedy output equals
    transformers' in fp32; sampled log-probs match the full forward. Skipped only where there is no C++
    compiler for inductor; with one, a compile failure (the rollout's silent eager fallback) fails the test."""
    from hybridflow.rollout.native.kernels import decoder_kernels

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for inductor on this machine (the rollout falls back to eager)")
    assert decoder_kernels(compile=True).compiled, "torch.compile failed with a C++ compiler present: see the log"
    model, tok = tiny(arch)
    batch = prompt_batch(tok)
    greedy = native(model, tok, do_sample=False, enforce_eager=False)
    assert greedy.kernels.compiled
    assert torch.equal(greedy.generate_sequences(batch).batch[RESPONSES], hf_greedy(model, tok, batch))
    sampled = native(model, tok, n=2, calculate_log_probs=True, enforce_eager=False).generate_sequences(batch)
    torch.testing.assert_close(
        sampled.batch[ROLLOUT_LOG_PROBS], recomputed_log_probs(model, sampled), atol=1e-4, rtol=0
    )


def test_extra_left_padding_is_trimmed_before_prefill(llama, monkeypatch):
    """Prompts padded wider than their longest row (the dataset pads to max_prompt_length) give the same
    responses and log-probs as tightly padded ones, the prefill sees only the used columns, and the
    output keeps the caller's prompt width."""
    model, tok = llama
    tight = prompt_batch(tok)
    extra = 5
    wide = tight.batch[INPUT_IDS].shape[1] + extra
    padded = {
        k: torch.cat([torch.full((3, extra), fill, dtype=tight.batch[k].dtype), tight.batch[k]], dim=1)
        for k, fill in ((INPUT_IDS, tok.pad_token_id), (ATTENTION_MASK, 0), (POSITION_IDS, 0))
    }
    loose = tight.select_idxs(torch.arange(3))
    for k, v in padded.items():
        loose.batch[k] = v
    rollout = native(model, tok, calculate_log_probs=True, do_sample=False)
    widths = []
    decoder = rollout._decoder()
    prefill = decoder.prefill
    monkeypatch.setattr(decoder, "prefill", lambda ids, *a: widths.append(ids.shape[1]) or prefill(ids, *a))
    monkeypatch.setattr(rollout, "_decoder", lambda rows: decoder)
    a, b = rollout.generate_sequences(tight), rollout.generate_sequences(loose)
    assert widths == [wide - extra, wide - extra]
    assert torch.equal(a.batch[RESPONSES], b.batch[RESPONSES])
    torch.testing.assert_close(a.batch[ROLLOUT_LOG_PROBS], b.batch[ROLLOUT_LOG_PROBS], rtol=0, atol=1e-5)
    assert b.batch[PROMPTS].shape[1] == wide and torch.equal(b.batch[PROMPTS], padded[INPUT_IDS])


PREAMBLE = (
    "You are a careful assistant. Read the question, think about it step by step, and answer "
    "with a single number on its own line, without any words before or after it. Question: "
)
SHARED = [PREAMBLE + q for q in ("What is 12 plus 7?", "How many legs do three spiders have in total?", "2+2?")]


def test_shared_prefix_layout_by_hand():
    pad = 0
    ids = torch.tensor([[pad, 5, 6, 7, 8, 9], [5, 6, 7, 8, 1, 2], [pad, pad, 5, 6, 7, 3]])
    mask = (ids != pad).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder_module, "SHARED_PREFIX_MIN_SAVING", 1)
        shared = decoder_module.shared_prefix(ids, mask, pos)
    assert shared.prefix_ids.tolist() == [[5, 6, 7]] and shared.prefix_pos.tolist() == [[0, 1, 2]]
    # the longest row's suffix is 3 wide; shorter rows' prefix tokens in those columns are masked out
    assert shared.suffix_ids.tolist() == [[7, 8, 9], [8, 1, 2], [6, 7, 3]]
    assert shared.suffix_mask.tolist() == [[False, True, True], [True, True, True], [False, False, True]]
    assert shared.suffix_pos.tolist() == [[2, 3, 4], [3, 4, 5], [1, 2, 3]]
    assert decoder_module.shared_prefix(ids, mask, pos) is None  # 3 tokens x 2 rows: too few to pay


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prefix_prefill_matches_transformers(arch, monkeypatch):
    """Prompts that start alike run their common prefix once; greedy output still equals HF generate
    and the sampled log-probs equal a full forward of the final sequences."""
    model, tok = tiny(arch)
    batch = prompt_batch(tok, SHARED)
    calls = []
    real = decoder_module.shared_prefix
    monkeypatch.setattr(decoder_module, "shared_prefix", lambda *a: calls.append(real(*a)) or calls[-1])
    out = native(model, tok, True, calculate_log_probs=True, do_sample=False).generate_sequences(batch)
    assert calls and calls[0] is not None and calls[0].prefix_ids.shape[1] >= 30
    assert torch.equal(out.batch[RESPONSES], hf_greedy(model, tok, batch))
    torch.testing.assert_close(out.batch[ROLLOUT_LOG_PROBS], recomputed_log_probs(model, out), atol=1e-4, rtol=0)


def test_identical_prompts_share_all_but_their_last_token_and_generate():
    """n identical prompts (an agent harness's n sessions of one row, batched by the server): the shared
    prefix leaves a one-token suffix, whose prefill must not take the one-token decode path."""
    from hybridflow.models import load_tokenizer, tiny_model_dir
    from hybridflow.rollout import RolloutConfig, build_rollout
    from hybridflow.rollout.base import left_padded
    from hybridflow.rollout.config import SamplingParams

    path = tiny_model_dir("llama")
    config = RolloutConfig(name="native", response_length=8, prompt_length=128, dtype="fp32")
    rollout = build_rollout(config, path, load_tokenizer(path))
    out = rollout.generate_sequences(left_padded([list(range(5, 105))] * 4, rollout.pad_id), SamplingParams(n=1))
    assert out.batch["responses"].shape == (4, 8)
