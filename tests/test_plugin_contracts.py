"""Every plugin kind's signature, pinned: the built-ins satisfy it, and a minimal user implementation in a module
of a temporary directory, named by `file.py:function` path, works through the same public entry point.

Kinds and where their signature is written: policy loss (algos/losses.py: its math, `PolicyLossInputs` ->
per-token loss, registered with `@policy_loss`; or the full `PolicyLossFn`), advantage estimator
(algos/adv_spec.py AdvantageEstimatorFn + AdvantageEstimatorSpec), KL estimator (algos/kl.py KLEstimatorFn),
loss aggregation (algos/core.py LossAggFn), preference loss (algos/dpo.py PairLossFn + PreferenceLoss), reward scorer (rewards/registry.py Scorer), rollout backend
(rollout/backends.py RolloutBuilder + RolloutBackendSpec), engine backend (workers/engines.py EngineBuilder).
"""

from __future__ import annotations

import inspect
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rollout_helpers import prompt_batch, tiny

from hybridflow.algos import GlobalNorm, agg_loss, get_policy_loss_fn, kl_penalty
from hybridflow.algos.adv_spec import ADV_ESTIMATORS, AdvantageEstimatorSpec, get_advantage_spec
from hybridflow.algos.core import LOSS_AGG_MODES
from hybridflow.algos.dpo import PREFERENCE_LOSSES, DPOLossConfig, PairLogps, dpo_loss
from hybridflow.algos.kl import KL_ESTIMATORS
from hybridflow.algos.losses import POLICY_LOSSES, PolicyLossConfig
from hybridflow.protocol.keys import RESPONSES
from hybridflow.rewards import default_compute_score
from hybridflow.rewards.registry import SCORERS
from hybridflow.rollout import ROLLOUT_BACKENDS, RolloutBackendSpec, RolloutConfig, build_rollout
from hybridflow.utils.plugins import PluginError, import_plugins
from hybridflow.workers.engines import ENGINES

B, R = 4, 5

FIVE_LINE_LOSS = """\
from hybridflow.algos import policy_loss

@policy_loss("reinforce_plugin")
def reinforce(x):
    return -x.advantages * x.log_prob, {"plugin_tokens": x.response_mask.sum()}
"""
"""A whole policy-loss plugin: its math and its registration (docs/extending.md shows the same)."""


@pytest.fixture(autouse=True)
def _restore_registries(isolated_registries):
    """User plugins imported here register names; each test leaves the registries as it found them."""


def _batch() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    old, new = torch.randn(B, R, generator=gen) - 2, torch.randn(B, R, generator=gen) - 2
    adv, mask = torch.randn(B, R, generator=gen), torch.ones(B, R)
    mask[1, 3:] = 0
    return old, new, adv, mask


def _module(tmp_path: Path, source: str) -> str:
    file = tmp_path / "user_plugin.py"
    file.write_text(textwrap.dedent(source))
    return str(file)


def _pairs() -> PairLogps:
    gen = torch.Generator().manual_seed(0)
    chosen, rejected, ref_c, ref_r = (torch.randn(B, generator=gen) * 5 - 20 for _ in range(4))
    tokens = torch.tensor([3.0, 5.0, 1.0, 8.0])
    return PairLogps(chosen.requires_grad_(), rejected, tokens, tokens + 1, ref_c, ref_r)


@pytest.mark.parametrize("name", ["sigmoid", "robust", "hinge", "ipo"])
def test_preference_loss_contract_builtins(name):
    losses = PREFERENCE_LOSSES.get(name).fn(
        *(torch.randn(B) for _ in range(2)), torch.ones(B), torch.ones(B), DPOLossConfig()
    )
    assert losses.shape == (B,)
    loss, stats = dpo_loss(_pairs(), DPOLossConfig(loss_type=name))
    assert loss.dim() == 0 and loss.requires_grad and all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_preference_loss_contract_user(tmp_path):
    path = _module(
        tmp_path,
        """
        def squared_margin(chosen_logratios, rejected_logratios, chosen_tokens, rejected_tokens, config):
            return (1 - config.beta * (chosen_logratios - rejected_logratios)) ** 2
        """,
    )
    cfg = DPOLossConfig(loss_type=f"{path}:squared_margin", beta=0.2)  # checked at load: the path resolves
    pairs = _pairs()
    loss, stats = dpo_loss(pairs, cfg)
    z = (pairs.chosen - pairs.ref_chosen) - (pairs.rejected - pairs.ref_rejected)
    assert torch.allclose(loss, ((1 - 0.2 * z) ** 2).mean()) and "rewards/margins" in stats


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "cispo", "sapo", "clip_cov", "kl_cov"])
def test_policy_loss_contract_builtins(name):
    old, new, adv, mask = _batch()
    loss, stats = POLICY_LOSSES.get(name)(
        old, new.requires_grad_(), adv, mask, loss_agg_mode="token-mean", config=PolicyLossConfig()
    )
    assert loss.dim() == 0 and loss.requires_grad
    assert {"pg_clipfrac", "ppo_kl"} <= set(stats) and all(
        not torch.is_tensor(v) or v.dim() == 0 for v in stats.values()
    )


def test_policy_loss_contract_user(tmp_path):
    path = _module(
        tmp_path,
        """
        from hybridflow.algos.losses import finish_policy_loss

        def neg_adv_logp(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                         config, global_norm=None, rollout_log_probs=None, rollout_is_weights=None):
            loss_mat = -advantages * log_prob
            stats = {"pg_clipfrac": loss_mat.new_zeros(())}
            return finish_policy_loss(loss_mat, old_log_prob, log_prob, response_mask, loss_agg_mode, config,
                                      global_norm, rollout_log_probs, stats, rollout_is_weights)
        """,
    )
    old, new, adv, mask = _batch()
    loss, stats = get_policy_loss_fn(f"{path}:neg_adv_logp")(old, new, adv, mask, config=PolicyLossConfig())
    expect = (-(adv * new) * mask).sum() / mask.sum()
    assert torch.allclose(loss, expect) and "ppo_kl" in stats


def test_policy_loss_contract_math_user(tmp_path):
    """The 5-line math form gets exactly what the full form gets from `finish_policy_loss`: IS corrections,
    aggregation by every mode with global counts, and the shared stats."""
    (tmp_path / "reinforce.py").write_text(FIVE_LINE_LOSS)
    full = _module(
        tmp_path,
        """
        from hybridflow.algos.losses import finish_policy_loss

        def neg_adv_logp(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                         config, global_norm=None, rollout_log_probs=None, rollout_is_weights=None):
            stats = {"plugin_tokens": response_mask.sum()}
            return finish_policy_loss(-advantages * log_prob, old_log_prob, log_prob, response_mask, loss_agg_mode,
                                      config, global_norm, rollout_log_probs, stats, rollout_is_weights)
        """,
    )
    import_plugins([str(tmp_path / "reinforce.py")])
    old, new, adv, mask = _batch()
    extra = {
        "rollout_log_probs": old + 0.1,
        "rollout_is_weights": torch.rand(B, R),
        "global_norm": GlobalNorm(30, 6, 2),
    }
    cfg = PolicyLossConfig(tis_imp_ratio_cap=1.05)
    for mode in LOSS_AGG_MODES.names():
        lp_math, lp_full = new.clone().requires_grad_(), new.clone().requires_grad_()
        loss, stats = get_policy_loss_fn("reinforce_plugin")(
            old, lp_math, adv, mask, loss_agg_mode=mode, config=cfg, **extra
        )
        ref, ref_stats = get_policy_loss_fn(f"{full}:neg_adv_logp")(
            old, lp_full, adv, mask, loss_agg_mode=mode, config=cfg, **extra
        )
        assert torch.equal(loss, ref) and loss.dim() == 0
        assert torch.equal(torch.autograd.grad(loss, lp_math)[0], torch.autograd.grad(ref, lp_full)[0])
        assert list(stats) == ["pg_clipfrac_lower", "pg_clipfrac", "plugin_tokens", "ppo_kl"]
        assert all(torch.equal(stats[k], ref_stats[k]) for k in stats)
    assert float(stats["pg_clipfrac"]) == float(stats["pg_clipfrac_lower"]) == 0.0 and int(stats["plugin_tokens"]) == 18
    with pytest.raises(ValueError, match="already registered"):
        (tmp_path / "again.py").write_text(FIVE_LINE_LOSS.replace("def reinforce", "def other"))
        import_plugins([str(tmp_path / "again.py")])


VARIED_SCORE = """\
from hybridflow.rewards import register_scorer

register_scorer("arithmetic", lambda solution_str, ground_truth: float(sum(map(ord, solution_str)) % 5), override=True)
"""
"""Scores that differ between a prompt's samples, so group advantages (and the loss's gradient) are not all 0."""


@pytest.mark.slow
def test_a_five_line_plugin_loss_trains_on_ray(tmp_path: Path):
    """trainer.plugins=[reinforce.py] with FIVE_LINE_LOSS: a 2-step Ray run of the tiny model trains with it in the
    worker processes (the loss's own stat comes back in the metrics, and its gradient is not 0)."""
    from test_trainer_cli import base_overrides, read_metrics, run_cli

    from hybridflow.models import tiny_model_dir

    assert len(FIVE_LINE_LOSS.splitlines()) == 5
    (tmp_path / "reinforce.py").write_text(FIVE_LINE_LOSS)
    (tmp_path / "varied_score.py").write_text(VARIED_SCORE)
    fast = ["trainer.n_workers_per_node=1", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    plugins = ["trainer.plugins=[reinforce.py,varied_score.py]", "actor.policy_loss_mode=reinforce_plugin"]
    args = ["train", *base_overrides(str(tiny_model_dir("llama")), tmp_path), *fast, *plugins, "trainer.backend=ray"]
    proc = run_cli(args, tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["actor/plugin_tokens"] > 0 and r["actor/pg_clipfrac"] == 0.0 and "actor/ppo_kl" in r
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_advantage_estimator_contract_builtins(name):
    spec = get_advantage_spec(name)
    assert isinstance(spec, AdvantageEstimatorSpec)
    _, _, rewards, mask = _batch()
    adv, ret = spec.fn(
        rewards, mask, np.array([0, 0, 1, 1]), values=torch.zeros(B, R), reward_baselines=torch.zeros(B), gamma=1.0
    )
    assert adv.shape == ret.shape == (B, R) and float(adv[1, 3:].abs().sum()) == 0.0
    assert not (spec.sync_only is False and spec.baseline is not None)  # a baseline generates with current weights


def test_advantage_estimator_contract_user(tmp_path):
    path = _module(
        tmp_path,
        """
        from hybridflow.algos import register_adv_est

        @register_adv_est("score_minus_half", needs_groups=True)
        def score_minus_half(token_level_rewards, response_mask, index, **unused):
            adv = (token_level_rewards - 0.5) * response_mask
            return adv, adv

        def bare(token_level_rewards, response_mask, index, **unused):
            return token_level_rewards, token_level_rewards
        """,
    )
    import_plugins([path])
    spec = get_advantage_spec("score_minus_half")
    assert spec.needs_groups and not spec.needs_critic and spec.baseline is None
    adv, _ = spec.fn(torch.ones(2, 3), torch.ones(2, 3), np.array([0, 0]))
    assert adv.tolist() == [[0.5] * 3] * 2
    bare = get_advantage_spec(f"{path}:bare")  # a bare function by path gets a spec that needs nothing
    assert bare == AdvantageEstimatorSpec(fn=bare.fn) and bare.fn(torch.ones(1, 2), torch.ones(1, 2), [0])[0].sum() == 2


def test_advantage_estimator_baseline_contract(tmp_path):
    path = _module(
        tmp_path,
        """
        from hybridflow.algos.adv_spec import AdvantageEstimatorSpec
        from hybridflow.algos.advantages import compute_remax_outcome_advantage

        def best_of_two(ctx):
            return ctx.generate_scores(do_sample=True, n=2).view(-1, 2).amax(-1).repeat_interleave(ctx.n)

        SPEC = AdvantageEstimatorSpec(compute_remax_outcome_advantage, baseline=best_of_two, sync_only=True)
        """,
    )
    calls = []

    def generate_scores(*, do_sample, n):
        calls.append((do_sample, n))
        return torch.tensor([1.0, 2.0, 0.0, 5.0])[: 2 * n]

    ctx = SimpleNamespace(n=3, generate_scores=generate_scores)
    assert get_advantage_spec(f"{path}:SPEC").baseline(ctx).tolist() == [2.0] * 3 + [5.0] * 3
    assert get_advantage_spec("remax").baseline(ctx).tolist() == [1.0] * 3 + [2.0] * 3  # one greedy per prompt
    assert calls == [(True, 2), (False, 1)]


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_contract_builtins(name):
    old, new, _, _ = _batch()
    assert KL_ESTIMATORS.get(name)(new, old).shape == (B, R)


def test_kl_estimator_contract_user(tmp_path):
    path = _module(tmp_path, "def sq(logprob, ref_logprob):\n    return (logprob - ref_logprob) ** 2\n")
    old, new, _, _ = _batch()
    torch.testing.assert_close(kl_penalty(new, old, f"{path}:sq"), (new - old) ** 2)


@pytest.mark.parametrize("name", LOSS_AGG_MODES.names())
def test_loss_agg_contract_builtins(name):
    _, new, _, mask = _batch()
    out = LOSS_AGG_MODES.get(name)(new, mask.bool(), None, None)
    assert out.dim() == 0 and torch.equal(out, agg_loss(new, mask, name))


def test_loss_agg_contract_user(tmp_path):
    path = _module(
        tmp_path,
        """
        def token_sum(loss_mat, valid, global_norm, norm_length):
            return loss_mat.where(valid, 0.0).sum()
        """,
    )
    _, new, _, mask = _batch()
    torch.testing.assert_close(agg_loss(new, mask, f"{path}:token_sum"), (new * mask).sum())


def test_reward_scorer_contract(tmp_path):
    truths = {"arithmetic": "4", "gsm8k": "4", "math": "4", "countdown": '{"target": 4, "numbers": [2, 2]}'}
    for name, truth in truths.items():
        assert isinstance(SCORERS.get(name)("#### 4 <answer>2+2</answer> \\boxed{4}", truth), (int, float))
    path = _module(
        tmp_path,
        """
        from hybridflow.rewards import register_scorer

        register_scorer("contract/exact", lambda solution_str, ground_truth: float(solution_str == ground_truth))
        """,
    )
    import_plugins([path])
    assert default_compute_score("contract/exact", "42", "42") == 1.0
    assert default_compute_score("contract/exact", "41", "42") == 0.0


@pytest.mark.parametrize("name", ROLLOUT_BACKENDS.names())
def test_rollout_backend_contract_builtins(name):
    spec = ROLLOUT_BACKENDS.get(name)
    assert isinstance(spec, RolloutBackendSpec)
    inspect.signature(spec.build).bind(RolloutConfig(), "model_dir", None, 1)


def test_rollout_backend_contract_user(tmp_path):
    path = _module(
        tmp_path,
        """
        from hybridflow.rollout import ROLLOUT_BACKENDS

        def first_token_only(config, model_path_or_module, tokenizer, tp_stride):
            from dataclasses import replace
            return ROLLOUT_BACKENDS.get("native").build(replace(config, name="native", response_length=1),
                                                        model_path_or_module, tokenizer, tp_stride)
        """,
    )
    model, tok = tiny("llama")
    cfg = RolloutConfig(name=f"{path}:first_token_only", dtype="fp32", do_sample=False, response_length=4)
    out = build_rollout(cfg, model, tok).generate_sequences(prompt_batch(tok))
    assert out.batch[RESPONSES].shape[1] == 1


@pytest.mark.parametrize("name", ENGINES.names())
def test_engine_backend_contract_builtins(name):
    from hybridflow.engine.config import EngineConfig

    inspect.signature(ENGINES.get(name)).bind("model_dir", EngineConfig(), None, False, None)


def test_engine_backend_contract_user(tmp_path):
    from hybridflow.engine.base import Engine
    from hybridflow.engine.config import EngineConfig
    from hybridflow.models import tiny_model_dir
    from hybridflow.workers.engines import build_engine

    path = _module(
        tmp_path,
        """
        from hybridflow.workers.engines import ENGINES

        def tagged_fsdp(path, cfg, optim, value_model, lora):
            engine = ENGINES.get("fsdp")(path, cfg, optim, value_model, lora)
            engine.built_by_plugin = True
            return engine
        """,
    )
    engine = build_engine(tiny_model_dir("llama"), EngineConfig(param_dtype="fp32", backend=f"{path}:tagged_fsdp"))
    assert isinstance(engine, Engine) and engine.built_by_plugin


def test_a_path_that_does_not_load_names_the_key(tmp_path):
    with pytest.raises(PluginError, match=r"actor.policy_loss_mode='.*nowhere.py:f': plugin file .* does not exist"):
        POLICY_LOSSES.get(f"{tmp_path}/nowhere.py:f")
    with pytest.raises(PluginError, match=r"rollout.name='no_such_pkg_q:f': cannot import module 'no_such_pkg_q'"):
        ROLLOUT_BACKENDS.get("no_such_pkg_q:f")


def test_engine_backend_is_chosen_by_the_config_and_checked_at_load():
    from hybridflow.config.run import RunConfig
    from hybridflow.engine.config import EngineConfig
    from hybridflow.utils.config_loader import ConfigError, load_config
    from hybridflow.workers.engines import engine_backend

    assert engine_backend(EngineConfig()) == "fsdp"
    assert engine_backend(EngineConfig(tensor_parallel_size=2)) == "fsdp_tp"
    assert engine_backend(EngineConfig(ulysses_sequence_parallel_size=2)) == "fsdp_sp"
    assert engine_backend(EngineConfig(tensor_parallel_size=2, backend="mine")) == "mine"
    with pytest.raises(ConfigError, match=r"critic.engine.backend='nope' is not a registered engine backend"):
        load_config(RunConfig, None, ["algorithm.adv_estimator=gae", "critic.engine.backend=nope"])
