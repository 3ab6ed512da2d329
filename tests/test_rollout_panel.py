"""The panel kernel (hybridflow/rollout/native/panel.py), AVX2 and AVX-512 builds: products against F.linear, the build."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from rollout_helpers import without_bf16_products

from hybridflow.rollout.native import panel

needs_kernel = pytest.mark.skipif(panel.kernel() is None, reason="no AVX2 + FMA CPU or no C compiler here")
needs_dot = pytest.mark.skipif(panel.kernel(panel.DOT) is None, reason="no avx512_bf16 CPU (or compiler) here")


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, 15), 64, 70])
def test_panel_products_equal_f_linear(rows: int):
    torch.manual_seed(rows)
    w, b, x = torch.randn(48, 40), torch.randn(48), torch.randn(rows, 40)
    panels = panel.to_panels(w)
    torch.testing.assert_close(panel.panel_linear(x, panels, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(panel.panel_linear(x, panels, None), F.linear(x, w), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_panel_products_keep_leading_dims_and_take_strided_inputs():
    w, x = torch.randn(64, 24), torch.randn(3, 5, 48)[..., ::2]  # every other column: not contiguous
    y = panel.panel_linear(x, panel.to_panels(w), None)
    assert y.shape == (3, 5, 64)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_avx512_is_built_where_torch_runs_avx512(monkeypatch):
    """AVX-512 where torch's capability is AVX512; its bf16 products only there and where the CPU lists them."""
    for cpu_bf16 in (True, False):
        listed = {"avx2", "fma", "avx512f", *["avx512_bf16"] * cpu_bf16}
        monkeypatch.setattr(panel, "_cpu_flags", lambda listed=listed: listed)
        for capability, avx512 in (("AVX512", True), ("AVX2", False), ("DEFAULT", False)):
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            assert ("-mavx512f" in panel.flags()) == avx512 and set(panel.FLAGS) <= set(panel.flags())
            assert ("-mavx512bf16" in panel.flags()) == (avx512 and cpu_bf16)


BUILDS = [panel.FLAGS] + [panel.FLAGS + panel.AVX512_FLAGS] * (torch.backends.cpu.get_cpu_capability() == "AVX512")
"""The AVX2 build everywhere it runs; the AVX-512 one too where this CPU runs it."""


@needs_kernel
@pytest.mark.parametrize("build", BUILDS, ids=lambda f: "avx512" if "-mavx512f" in f else "avx2")
def test_each_build_multiplies_like_f_linear_and_like_the_other(build: list[str]):
    """Every block size of either build (1-14 rows, and blocks of 12 / 6 with a remainder), fp32 and bf16 panels;
    the two builds add each output in the same order, so their products are the same numbers."""
    kernels, avx2 = panel._load(build), panel._load(panel.FLAGS)
    torch.manual_seed(0)
    w, b = torch.randn(48, 40), torch.randn(48)
    for rows in [*range(1, 15), 25, 64, 70]:
        x = torch.randn(rows, 40)
        for dtype in (torch.float32, torch.bfloat16):
            panels = panel.to_panels(w, dtype=dtype)
            y = panel.panel_linear(x, panels, b, fn=kernels[dtype])
            torch.testing.assert_close(y, F.linear(x, w.to(dtype).float(), b), atol=1e-5, rtol=1e-5)
            assert torch.equal(y, panel.panel_linear(x, panels, b, fn=avx2[dtype]))


def test_only_cpu_weights_with_whole_panels_fit_and_bf16_ones_only_bf16_panels():
    assert panel.fits(torch.zeros(32, 8))
    assert not panel.fits(torch.zeros(40, 8))  # 40 output columns: not whole panels of 16
    assert not panel.fits(torch.zeros(32, 8, dtype=torch.bfloat16))
    assert panel.fits(torch.zeros(32, 8, dtype=torch.bfloat16), torch.bfloat16)
    assert not panel.fits(torch.zeros(32, 8, dtype=torch.float16), torch.bfloat16)


@needs_kernel
def test_the_kernel_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    built = panel._build(panel.flags())
    assert built.parent == tmp_path / "kernels" and built.exists()
    stamp = built.stat().st_mtime_ns
    assert panel._build(panel.flags()) == built and built.stat().st_mtime_ns == stamp  # found, not compiled again
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temporary left behind


@needs_kernel
def test_without_a_compiler_the_kernel_is_absent_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="hybridflow.rollout.native.panel"):
        assert panel._load() is None
    assert "no C compiler 'no-such-compiler'" in caplog.text and "torch's products" in caplog.text


def test_stacked_blocks_are_laid_out_as_their_stack(monkeypatch):
    """Fused q/k/v (gate/up) in panels straight from the blocks: the same layout as panels of their cat."""
    import hybridflow.rollout.native.linear as linear

    q, k, v, b = torch.randn(32, 24), torch.randn(16, 24), torch.randn(16, 24), torch.randn(64)
    assert torch.equal(panel.to_panels(q, k, v), panel.to_panels(torch.cat([q, k, v])))
    for path in linear._usable_paths(q):
        monkeypatch.setattr(linear, "_choose", lambda *args, path=path: path)
        fused = linear.Linear([q, k, v], b)
        assert fused.path == path
        x = torch.randn(5, 24)
        torch.testing.assert_close(fused(x), F.linear(x, torch.cat([q, k, v]), b), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_bf16_panels_compute_in_fp32_on_the_rounded_weights():
    import hybridflow.rollout.native.linear as linear

    w, b, x = torch.randn(48, 40), torch.randn(48), torch.randn(7, 40)
    lin = linear.Linear(w, b, weight_dtype=torch.bfloat16)
    assert lin.path == "bf16_panels" and lin.panels.dtype == torch.bfloat16
    torch.testing.assert_close(lin(x), F.linear(x, w.bfloat16().float(), b), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_bf16_weight_takes_bf16_panels_or_casts_fp32_inputs_where_it_cannot(monkeypatch):
    """A bf16 model's weight with bf16 panels asked for: the same numbers as the fp32 copy's bf16 panels (bias
    widened); where its rows are not whole panels (40) it keeps a bf16 path and casts fp32 inputs to bf16."""
    import hybridflow.rollout.native.linear as linear

    without_bf16_products(monkeypatch)
    w, b, x = torch.randn(48, 40).bfloat16(), torch.randn(48).bfloat16(), torch.randn(7, 40)
    lin = linear.Linear(w, b, weight_dtype=torch.bfloat16)
    assert lin.path == "bf16_panels" and lin.bias.dtype == torch.float32
    assert torch.equal(lin(x), linear.Linear(w.float(), b.float(), weight_dtype=torch.bfloat16)(x))
    odd = linear.Linear(w[:40], b[:40], weight_dtype=torch.bfloat16)
    assert odd.path in ("plain", "packed")
    torch.testing.assert_close(odd(x).float(), F.linear(x.bfloat16(), w[:40], b[:40]).float())


@needs_kernel
def test_a_bf16_weight_rollout_samples_as_fp32_math_on_bf16_rounded_weights(monkeypatch):
    """rollout.weight_dtype=bf16: the same tokens and bit-identical log-probs as an fp32 rollout whose model
    weights were rounded to bf16 (both on the panel kernel: same math, same order); and not the fp32 model's."""
    from rollout_helpers import prompt_batch, tiny

    import hybridflow.rollout.native.linear as linear
    from hybridflow.protocol.keys import RESPONSES, ROLLOUT_LOG_PROBS
    from hybridflow.rollout import RolloutConfig
    from hybridflow.rollout.native.rollout import NativeRollout

    model, tok = tiny("llama")
    prompts = prompt_batch(tok)
    cfg = RolloutConfig(name="native", dtype="fp32", do_sample=False, response_length=8, calculate_log_probs=True)
    bf16 = NativeRollout(replace(cfg, weight_dtype="bf16"), model, tok).generate_sequences(prompts)
    exact = NativeRollout(cfg, model, tok).generate_sequences(prompts)
    monkeypatch.setattr(linear, "_choose", lambda *args: "panels")
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for layer in model.model.layers:
                getattr(layer.self_attn, name).weight.copy_(getattr(layer.self_attn, name).weight.bfloat16())
        for layer in model.model.layers:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(layer.mlp, name).weight.bfloat16())
    # a new parameter: the LM head rounded, the (tied) input embedding left in fp32 as the bf16 rollout reads it
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().bfloat16().float())
    rounded = NativeRollout(cfg, model, tok).generate_sequences(prompts)
    assert torch.equal(bf16.batch[RESPONSES], rounded.batch[RESPONSES])
    assert torch.equal(bf16.batch[ROLLOUT_LOG_PROBS], rounded.batch[ROLLOUT_LOG_PROBS])
    assert not torch.equal(bf16.batch[ROLLOUT_LOG_PROBS], exact.batch[ROLLOUT_LOG_PROBS])


def test_weight_dtype_is_checked_at_load():
    from hybridflow.rollout import RolloutConfig

    with pytest.raises(ValueError, match="rollout.weight_dtype must be null or 'bf16'"):
        RolloutConfig(weight_dtype="fp16")
    with pytest.raises(ValueError, match="is for the native rollout"):
        RolloutConfig(name="hf", weight_dtype="bf16")


def test_a_column_chunk_is_laid_out_like_its_copy():
    """tp > 1 splits o / down by columns: a strided view of the full weight."""
    w = torch.randn(32, 24)
    chunk = w[:, 8:16]
    assert not chunk.is_contiguous()
    assert torch.equal(panel.to_panels(chunk), panel.to_panels(chunk.contiguous()))


@needs_kernel
@pytest.mark.parametrize("k", [8, 24, 576, 20])
def test_the_tiled_repack_writes_the_panel_layout(k: int, monkeypatch):
    """hf_to_panels (K a multiple of 8; rows contiguous or a column chunk's strided rows) against torch's strided
    copy; K = 20 takes the copy."""
    asked = []
    real = panel.kernel
    monkeypatch.setattr(panel, "kernel", lambda key=torch.float32: asked.append(key) or real(key))
    w = torch.randn(48, 3 * k)
    for weight in (w[:, :k].contiguous(), w[:, k : 2 * k]):
        want = weight.reshape(3, 16, k).transpose(1, 2)
        assert torch.equal(panel.to_panels(weight), want)
    assert asked.count(panel._REPACK) == 2


@needs_dot
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 25, 64])
def test_dot_products_are_bf16_products_with_fp32_sums(rows: int):
    """`panel.DOT` on panels of column pairs: x rounded to bf16 (nearest even; 34 inputs: a rounding tail past
    the 16-wide conversion), products of bf16 values summed in fp32, the bias added in fp32."""
    torch.manual_seed(rows)
    for n, k in ((48, 34), (64, 576)):
        w, b, x = torch.randn(n, k).bfloat16(), torch.randn(n), torch.randn(rows, k)
        panels = panel.to_panels(w, dtype=torch.bfloat16, pairs=True)
        laid = panels.view(n // panel.PANEL, k // 2, panel.PANEL, 2)
        assert torch.equal(laid[1, 3, 5], w[panel.PANEL + 5, 6:8])  # panel 1, column 5, inputs 6 and 7
        y = panel.panel_linear(x, panels, b, panel.kernel(panel.DOT))
        want = (x.bfloat16().double() @ w.double().T + b.double()).float()
        torch.testing.assert_close(y, want, atol=1e-5 * k**0.5, rtol=1e-5)
        assert not torch.allclose(y, F.linear(x, w.float(), b), atol=1e-4, rtol=0)  # x was rounded
    big = torch.randn(32, 80).bfloat16()
    for chunk in (big[:, 16:48], big[:, 2:36]):  # strided rows (a tp column chunk): by the tiled transpose, by torch
        want = panel.to_panels(chunk.contiguous(), dtype=torch.bfloat16, pairs=True)
        assert torch.equal(panel.to_panels(chunk, dtype=torch.bfloat16, pairs=True), want)


@needs_dot
def test_a_bf16_weight_takes_the_bf16_products_where_they_run():
    """A bf16 model's own weight with bf16 panels asked for: "bf16_dot"; an fp32 weight rounded to bf16
    (rollout.weight_dtype=bf16) keeps fp32 math; an odd number of inputs cannot pair."""
    import hybridflow.rollout.native.linear as linear

    w, b, x = torch.randn(48, 40).bfloat16(), torch.randn(48).bfloat16(), torch.randn(7, 40)
    lin = linear.Linear(w, b, weight_dtype=torch.bfloat16)
    assert lin.path == "bf16_dot" and lin.bias.dtype == torch.float32
    torch.testing.assert_close(lin(x), F.linear(x.bfloat16().float(), w.float(), b.float()), atol=1e-5, rtol=1e-5)
    assert linear.Linear(w.float(), b.float(), weight_dtype=torch.bfloat16).path == "bf16_panels"
    assert linear.Linear(w[:, :39], b, weight_dtype=torch.bfloat16).path == "bf16_panels"
    assert not panel.fits(w.float(), pairs=True)


def test_a_compiler_without_avx512_bf16_still_builds_the_rest(monkeypatch, caplog):
    """The build with -mavx512bf16 fails: the library is built without it, `panel.DOT` absent, the rest there."""
    if not panel._cpu_has_avx2_fma():
        pytest.skip("no AVX2 + FMA CPU here")
    real = panel._build

    def build(flags):
        if set(panel.BF16_FLAGS) <= set(flags):
            raise OSError("cc: error: unrecognized command-line option '-mavx512bf16'")
        return real(flags)

    monkeypatch.setattr(panel, "_build", build)
    with caplog.at_level(logging.WARNING):
        kernels = panel._load([*panel.FLAGS, *panel.BF16_FLAGS])
    assert kernels is not None and panel.DOT not in kernels and torch.float32 in kernels
    assert "bf16 products did not build" in caplog.text
