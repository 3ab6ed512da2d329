"""The actor update of `ActorRolloutRefWorker` (in-process backend): old log-probs recomputed or taken on-policy."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.run import RunConfig
from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.engine import EngineConfig, OptimConfig
from hybridflow.models import tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout import RolloutConfig
from hybridflow.utils.config_loader import load_config
from hybridflow.workers import ActorConfig, ActorRolloutRefWorker, ModelConfig, RefConfig
from tests.engine_helpers import make_batch
from tests.resolve_helpers import resolve_here


def _actor(**kwargs) -> LocalWorkerGroup:
    kwargs = {"ppo_mini_batch_size": 4, **kwargs}
    cfg = ActorConfig(
        ppo_micro_batch_size_per_device=2,
        log_prob_micro_batch_size_per_device=4,
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(param_dtype="fp32"),
        **kwargs,
    )
    group = LocalWorkerGroup(
        None,
        ClassWithInitArgs(
            ActorRolloutRefWorker,
            ModelConfig(path=str(tiny_model_dir("llama"))),
            cfg,
            RolloutConfig(n=1),
            RefConfig(),
            "actor",
        ),
    )
    group.init_model()
    return group


T = 1.0  # the sampling temperature the log-probs are taken at


def _rollout_batch() -> DataProto:
    data = make_batch(4, 6, 5, seed=11)
    mask = data[K.ATTENTION_MASK][:, -5:]
    data[K.RESPONSE_MASK] = mask
    data[K.ADVANTAGES] = torch.tensor([1.0, -0.5, 0.25, -1.0])[:, None] * mask
    return DataProto.from_dict(data)


def _weights(group: LocalWorkerGroup) -> dict[str, torch.Tensor]:
    return group._worker.actor.full_state_dict()


def _one_step(metrics: dict) -> dict[str, float]:
    """Per-optimizer-step lists (one step here) -> floats."""
    return {k: v[0] if isinstance(v, list) else v for k, v in metrics.items()}


def test_on_policy_update_equals_the_update_with_recomputed_old_log_probs():
    recomputed, on_policy = _actor(), _actor()
    batch = _rollout_batch()
    old = recomputed.compute_log_prob(batch, temperature=T)
    m_re = _one_step(
        recomputed.update_actor(batch.union(old), temperature=T, own_old_log_prob=False).meta_info["metrics"]
    )
    m_on = _one_step(
        on_policy.update_actor(_rollout_batch(), temperature=T, own_old_log_prob=True).meta_info["metrics"]
    )
    assert m_on["actor/pg_loss"] == pytest.approx(m_re["actor/pg_loss"], rel=1e-4)
    assert m_on["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7) and m_re["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-5)
    # entropy of the update forward, logged instead of compute_log_prob's (same weights, same rows)
    assert m_on["actor/entropy"] == pytest.approx(old.meta_info["metrics"]["actor/entropy"], rel=0.05)
    w_re, w_on = _weights(recomputed), _weights(on_policy)
    for k in w_re:
        torch.testing.assert_close(w_on[k], w_re[k], atol=1e-5, rtol=1e-4)
    fresh = _weights(_actor())
    assert any(not torch.equal(w_on[k], fresh[k]) for k in fresh)  # the update did change the weights


@pytest.mark.parametrize("kwargs", [dict(ppo_epochs=2), dict(ppo_mini_batch_size=2)])
def test_on_policy_update_refuses_more_than_one_optimizer_step(kwargs):
    with pytest.raises(ValueError, match="needs exactly one optimizer step.*call compute_log_prob first"):
        _actor(**kwargs).update_actor(_rollout_batch(), temperature=T, own_old_log_prob=True)


def test_update_without_old_log_probs_is_refused_unless_the_plan_says_so():
    with pytest.raises(ValueError, match="rows lack 'old_log_probs'; call compute_log_prob first"):
        _actor().update_actor(_rollout_batch(), temperature=T, own_old_log_prob=False)


@pytest.mark.parametrize(
    "overrides, needed",
    [
        ([], False),  # the default job: one optimizer step per batch
        (["actor.old_log_prob=recompute"], True),
        (["actor.ppo_epochs=2"], True),
        (["actor.ppo_mini_batch_size=4"], True),  # two mini-batches of the 8 prompts
        (["algorithm.use_kl_in_reward=true"], True),
        (["actor.ppo_mini_batch_size=4", "actor.old_log_prob=rollout"], False),  # the rollout's log-probs
    ],
)
def test_old_log_prob_pass_is_skipped_only_for_one_step_updates(overrides, needed):
    # bf16 actor: auto never takes the rollout's log-probs there (see the next tests), on any CPU
    base = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.engine.param_dtype=bf16"]
    cfg = load_config(RunConfig, None, [*base, *overrides])
    assert resolve_here(cfg, steps_per_epoch=4).recompute_old_log_prob is needed


FP32 = ["actor.engine.param_dtype=fp32", "rollout.dtype=fp32"]
TWO_STEPS = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4"]


def test_auto_takes_the_rollouts_log_probs_where_they_are_the_trainers_numbers():
    """fp32 native rollout beside an fp32 actor, two optimizer steps: auto resolves to rollout (no pass; the
    parity guard checks them at the update's first step), the rollout computes its log-probs, and the log says so."""
    run = resolve_here(load_config(RunConfig, None, [*TWO_STEPS, *FP32]), steps_per_epoch=4)
    assert run.config.actor.old_log_prob == "rollout" and run.recompute_old_log_prob is False
    assert run.config.rollout.calculate_log_probs is True
    assert any("actor.old_log_prob=auto -> rollout" in note for note in run.notes)


@pytest.mark.parametrize(
    "overrides, mode",
    [
        (["actor.ppo_mini_batch_size=8"], "auto"),  # one optimizer step: the update's own forward, exact
        (["actor.engine.param_dtype=bf16"], "auto"),
        (["rollout.dtype=bf16"], "auto"),
        (["rollout.weight_dtype=bf16"], "auto"),
        (["rollout.name=hf"], "auto"),
        (["trainer.parity=off"], "auto"),  # nothing would check them
        (["rollout.calculate_log_probs=false"], "auto"),
        (["algorithm.use_kl_in_reward=true"], "auto"),
        (["actor.lora.rank=4"], "auto"),
        (["actor.engine.pipeline_model_parallel_size=2"], "auto"),
        (["actor.old_log_prob=recompute"], "recompute"),  # a user value is never overwritten
    ],
)
def test_auto_keeps_the_pass_anywhere_else(overrides, mode):
    run = resolve_here(load_config(RunConfig, None, [*TWO_STEPS, *FP32, *overrides]), steps_per_epoch=4)
    assert run.config.actor.old_log_prob == mode
    assert run.recompute_old_log_prob is (overrides != ["actor.ppo_mini_batch_size=8"])


def test_old_log_probs_from_the_rollout_give_the_recomputed_update_and_check_the_first_step():
    """actor.old_log_prob=rollout over two optimizer steps: with rollout log-probs equal to the trainer's the
    update is the recomputed one; the parity numbers and the entropy come from the first step's forward only."""
    recomputed, from_rollout = _actor(ppo_mini_batch_size=2), _actor(ppo_mini_batch_size=2, old_log_prob="rollout")
    batch = _rollout_batch()
    computed = recomputed.compute_log_prob(batch, temperature=T).batch
    old, entropy = computed[K.OLD_LOG_PROBS], computed[K.ENTROPYS]
    recomputed.update_actor(
        _rollout_batch().union(DataProto.from_dict({K.OLD_LOG_PROBS: old})), temperature=T, own_old_log_prob=False
    )
    skew = torch.tensor([0.0, 0.0, 0.5, 0.5])[:, None] * batch.batch[K.RESPONSE_MASK]  # rows of the 2nd step only
    rows = _rollout_batch().union(DataProto.from_dict({K.ROLLOUT_LOG_PROBS: old + skew, K.OLD_LOG_PROBS: old}))
    metrics = from_rollout.update_actor(rows, temperature=T, own_old_log_prob=False, parity_ratio=0.2)
    metrics = metrics.meta_info["metrics"]
    assert len(metrics["actor/pg_loss"]) == 2 and len(metrics["actor/parity_gap_max"]) == 1  # one micro-batch
    assert metrics["actor/parity_gap_max"][0] < 1e-5  # the first step's rows: no skew
    mask = batch.batch[K.RESPONSE_MASK][:2]  # actor/entropy: the first step's forward, on its rows
    assert metrics["actor/entropy"] == [pytest.approx(float((entropy[:2] * mask).sum() / mask.sum()), abs=1e-5)]
    w_re, w_ro = _weights(recomputed), _weights(from_rollout)
    for k in w_re:
        torch.testing.assert_close(w_ro[k], w_re[k], atol=1e-6, rtol=1e-5)


def test_old_log_probs_from_the_rollout_need_its_log_probs_and_nothing_to_correct():
    base = ["actor.old_log_prob=rollout"]
    with pytest.raises(ValueError, match="rollout.calculate_log_probs=false; set it to true"):
        load_config(RunConfig, None, [*base, "rollout.calculate_log_probs=false"])
    for key in ("algorithm.rollout_is_threshold=2.0", "actor.policy_loss.tis_imp_ratio_cap=2.0"):
        with pytest.raises(ValueError, match="there is nothing to correct"):
            load_config(RunConfig, None, [*base, key])
    resolved = resolve_here(load_config(RunConfig, None, [*base, "trainer.parity=off"]), steps_per_epoch=4)
    assert resolved.config.rollout.calculate_log_probs is True
    from hybridflow.train.ppo_trainer import _rollout_log_probs

    with pytest.raises(ValueError, match="rollout.name=mine returned none; set actor.old_log_prob=auto"):
        _rollout_log_probs(_rollout_batch(), "mine")  # a plugin backend without log-probs


def test_unknown_old_log_prob_mode_is_rejected():
    with pytest.raises(ValueError, match="actor.old_log_prob"):
        ActorConfig(old_log_prob="sometimes")


def test_token_budget_micro_batches_give_the_row_micro_batch_update():
    by_rows, by_tokens = _actor(), _actor(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=12)
    batch = _rollout_batch()
    old = by_rows.compute_log_prob(batch, temperature=T)
    by_tokens_old = by_tokens.compute_log_prob(batch, temperature=T)
    torch.testing.assert_close(by_tokens_old.batch[K.OLD_LOG_PROBS], old.batch[K.OLD_LOG_PROBS])
    m_rows = _one_step(
        by_rows.update_actor(batch.union(old), temperature=T, own_old_log_prob=False).meta_info["metrics"]
    )
    m_tokens = _one_step(
        by_tokens.update_actor(batch.union(old), temperature=T, own_old_log_prob=False).meta_info["metrics"]
    )
    assert m_tokens["actor/loss"] == pytest.approx(m_rows["actor/loss"], rel=1e-4)  # the whole mini-batch's loss
    w_rows, w_tokens = _weights(by_rows), _weights(by_tokens)
    for k in w_rows:
        torch.testing.assert_close(w_tokens[k], w_rows[k], atol=1e-5, rtol=1e-4)
