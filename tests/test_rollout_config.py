"""RolloutConfig validation, sampling-param resolution, logit filters, backend selection errors."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from hybridflow.config.run import RunConfig
from hybridflow.rollout import RolloutConfig, SamplingParams, ValKwargs, build_rollout
from hybridflow.rollout.backends import check_backend
from hybridflow.rollout.sampling import filter_logits, sample_next
from hybridflow.utils.config_loader import load_config


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"dtype": "fp16"}, "rollout.dtype"),
        ({"top_p": 0.0}, "rollout.top_p"),
        ({"top_k": 0}, "rollout.top_k"),
        ({"temperature": 0.0}, "rollout.temperature"),
        ({"n": 4, "do_sample": False}, "rollout.do_sample"),
        ({"response_length": 0}, "rollout.response_length"),
        ({"max_batch_size": 0}, "rollout.max_batch_size"),
        ({"val_kwargs": {"n": 2}}, "rollout.val_kwargs"),
    ],
)
def test_bad_combinations_are_rejected_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_an_unknown_backend_is_rejected_at_load_naming_the_key():
    """The backend is looked up where a run is loaded (RunConfig) and where a rollout is built, not by RolloutConfig
    itself (the backends import the rollout config)."""
    with pytest.raises(ValueError, match="rollout.name"):
        check_backend(RolloutConfig(name="sglang"))
    with pytest.raises(ValueError, match="rollout.name"):
        load_config(RunConfig, None, ["rollout.name=sglang"])


def test_sampling_params_from_config_and_validation():
    cfg = RolloutConfig(temperature=0.8, top_p=0.9, n=4, val_kwargs={"temperature": 0.5, "do_sample": True})
    assert isinstance(cfg.val_kwargs, ValKwargs)
    assert cfg.sampling_params() == SamplingParams(0.8, 0.9, -1, True, 4)
    assert cfg.sampling_params(validate=True) == SamplingParams(0.5, 1.0, -1, True, 1)
    assert replace(cfg.sampling_params(), do_sample=False, n=1).do_sample is False
    with pytest.raises(ValueError, match="do_sample"):
        replace(cfg.sampling_params(), do_sample=False)  # greedy with n=4 identical samples


def test_filter_logits_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2, top_p=1.0)) == [True, True, False, False, False]
    assert keep(filter_logits(logits, top_k=-1, top_p=0.5)) == [True, False, False, False, False]
    assert keep(filter_logits(logits, top_k=-1, top_p=0.6)) == [True, True, False, False, False]
    assert keep(filter_logits(logits, top_k=-1, top_p=0.86)) == [True, True, True, True, False]
    assert keep(filter_logits(logits, top_k=3, top_p=0.99)) == [True, True, True, False, False]


def test_sample_next_log_probs_are_before_filtering():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, SamplingParams(top_k=1), gen)
    assert tokens.item() == 0 and logp.item() == pytest.approx(torch.log(torch.tensor(0.7)).item(), abs=1e-6)
    tokens, logp = sample_next(logits, SamplingParams(temperature=2.0), gen)
    expect = (logits / 2.0).log_softmax(-1)[0, tokens.item()]
    assert logp.item() == pytest.approx(expect.item(), abs=1e-6)


def test_build_rollout_errors():
    cfg = RolloutConfig()
    cfg.name = "tgi"  # bypasses __post_init__, as a config mutated after load would
    with pytest.raises(ValueError, match="native"):
        build_rollout(cfg, "unused", None)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_rollout_without_vllm_gives_a_clear_error():
    with pytest.raises(RuntimeError, match=r"setup.sh --vllm .* or use rollout.name=native"):
        build_rollout(RolloutConfig(name="vllm"), "unused", None)


@pytest.mark.parametrize("block", [1024, 2, 3])  # one padded block; blocks of 2 (a zero-mass block); 3 (padded)
def test_draw_follows_the_distribution_and_skips_zero_probability(block):
    from hybridflow.rollout.sampling import draw

    probs = torch.tensor([[0.0, 0.5, 0.3, 0.0, 0.0, 0.0, 0.2]]).expand(20000, 7)
    tokens = draw(probs, torch.Generator().manual_seed(0), block=block)
    freq = torch.bincount(tokens, minlength=7).float() / len(tokens)
    assert freq[0] == 0 and freq[3:6].sum() == 0
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)
