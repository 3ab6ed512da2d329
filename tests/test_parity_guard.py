"""The log-prob / token parity checks and the guard (hybridflow/parity/): math against hand-computed values,
error / warn / off, the config, and that a ParityError is never retried. End-to-end runs: test_parity_cli.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from faults import armed
from ray.exceptions import RayTaskError

from hybridflow.config.run import RunConfig
from hybridflow.parity import ParityError
from hybridflow.parity.config import ParityThresholds, Thresholds, parity_rollout_fields
from hybridflow.parity.guard import ParityGuard
from hybridflow.parity.logprob import logprob_gaps
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.protocol.token_hash import MOD, hash_ids, hash_list_rows, hash_rows, mismatched_rows
from hybridflow.rollout.config import RolloutConfig
from hybridflow.train.recovery import is_worker_failure
from hybridflow.utils.config_loader import ConfigError, load_config

G0, G1, G2 = 48271, 182605794, 1291394886  # 48271^(k+1) mod (2^31 - 1), k = 0, 1, 2


def test_the_hash_of_sampled_ids_matches_hand_computed_values():
    assert hash_ids([]) == 0
    assert hash_ids([5]) == 6 * G0
    assert hash_ids([5, 0]) == (6 * G0 + 1 * G1) % MOD == 182895420
    assert hash_ids([5, 0, 9]) == (6 * G0 + G1 + 10 * G2) % MOD


def test_rows_hash_their_trained_ids_in_order_skipping_observation_tokens():
    responses = torch.tensor([[5, 77, 0, 3], [5, 0, 3, 3]])
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])  # row 0: an observation token (77) between two turns
    assert hash_rows(responses, mask).tolist() == [hash_ids([5, 0])] * 2
    assert hash_list_rows([[5, 0], []]).tolist() == [hash_ids([5, 0]), 0]


@pytest.mark.parametrize(
    "trained",
    [[5, 1, 9], [0, 5, 9], [5, 0], [5, 0, 9, 2], [5, 9]],  # one id changed, two swapped, one dropped, one added
)
def test_any_edit_of_the_trained_ids_is_a_mismatch(trained: list[int]):
    sampled = torch.tensor([hash_ids([5, 0, 9])])
    responses = torch.tensor([trained + [0] * (4 - len(trained))])
    mask = torch.tensor([[1] * len(trained) + [0] * (4 - len(trained))])
    assert mismatched_rows(sampled, responses, mask) == [0]
    assert mismatched_rows(sampled, torch.tensor([[5, 0, 9, 4]]), torch.tensor([[1, 1, 1, 0]])) == []


def test_logprob_gaps_match_hand_computed_values():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -9.0]])
    rollout = torch.tensor([[-1.1, -2.0, -1.5], [-0.3, -0.5, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # d = 0.1, 0, 0, 0.3 on the trained tokens
    gaps = logprob_gaps(trainer, rollout, mask, ratio=0.2)
    assert gaps.tokens == 4
    assert gaps.gap_mean == pytest.approx(0.1, abs=1e-6)  # (0.1 + 0.3) / 4
    assert gaps.gap_max == pytest.approx(0.3, abs=1e-6)
    assert gaps.frac_beyond == 0.25  # exp(0.3) - 1 = 0.35 > 0.2; exp(0.1) - 1 = 0.105 is not
    assert logprob_gaps(trainer, rollout, torch.zeros_like(mask), 0.2).tokens == 0


LIMITS = Thresholds(gap_mean=0.01, gap_max=0.1, ratio=0.2, frac_beyond=0.0)


def _batch(findings: list[str] | None = None, skew: float = 0.0, edit: bool = False, old: bool = True) -> DataProto:
    responses = torch.tensor([[5, 0, 9, 2], [7, 7, 1, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    logp = torch.full((2, 4), -1.0) * mask
    tensors = {
        K.PROMPTS: torch.zeros(2, 3, dtype=torch.long),
        K.RESPONSES: responses,
        K.RESPONSE_MASK: mask,
        K.SAMPLED_IDS_HASH: hash_rows(responses, mask),
        K.ROLLOUT_LOG_PROBS: logp - skew * mask,
    }
    if old:
        tensors[K.OLD_LOG_PROBS] = logp.clone()
    tensors[K.INPUT_IDS] = torch.cat([tensors[K.PROMPTS], responses], dim=1)
    if edit:  # what the update reads, not responses: a batch whose two copies of the ids disagree is caught too
        tensors[K.INPUT_IDS][1, 4] = 8
    return DataProto.from_dict(tensors, meta_info={K.META_PARITY: findings or []})


def test_a_healthy_batch_passes_with_every_metric():
    metrics = ParityGuard("error", LIMITS).before_update(_batch(), step=3)
    assert metrics == {
        "parity/weight_findings": 0.0,
        "parity/token_checked_rows": 2.0,
        "parity/token_mismatch_rows": 0.0,
        "parity/logprob_checked": 1.0,
        "parity/logprob_in_update": 0.0,
        "parity/logprob_gap_mean": 0.0,
        "parity/logprob_gap_max": 0.0,
        "parity/logprob_frac_beyond": 0.0,
    }


@pytest.mark.parametrize(
    "batch, check, detail",
    [
        (_batch(edit=True), "tokens", "1 of 2 rows (single-turn rollout, rollout.name=native) train ids that are not "),
        (_batch(skew=0.5), "logprobs", "gap_mean 0.5 > 0.01, gap_max 0.5 > 0.1, frac_beyond 1 > 0"),
        (
            _batch(findings=["sync at step 4: 2 differ; usual cause: X"]),
            "weights",
            "sync at step 4: 2 differ; usual cause: X",
        ),
    ],
)
def test_each_check_fires_naming_itself_the_step_and_the_cause(batch, check, detail, caplog):
    with pytest.raises(ParityError, match=f"parity check '{check}' failed at step 4: ") as err:
        ParityGuard("error", LIMITS, "native").before_update(batch, step=4)
    assert detail in str(err.value) and "sual cause: " in str(err.value)  # a weight finding carries its own
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        metrics = ParityGuard("warn", LIMITS, "native").before_update(batch, step=4)
    assert f"parity check '{check}' failed at step 4" in caplog.text
    assert metrics["parity/token_mismatch_rows"] == float(check == "tokens")
    assert ParityGuard("off", LIMITS).before_update(batch, step=4) == {}


def test_nan_log_probs_breach():
    batch = _batch()
    batch.batch[K.OLD_LOG_PROBS][0, 0] = math.nan
    with pytest.raises(ParityError, match="gap_mean nan > 0.01"):
        ParityGuard("error", LIMITS).before_update(batch, step=1)


def test_without_rollout_log_probs_the_check_says_it_did_not_run(caplog):
    batch = _batch()
    batch.batch.pop(K.ROLLOUT_LOG_PROBS)
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        metrics = ParityGuard("error", LIMITS).before_update(batch, step=1)
    assert metrics["parity/logprob_checked"] == 0.0 and "parity/logprob_gap_mean" not in metrics
    assert "log-prob check is skipped" in caplog.text


def test_off_policy_rows_from_older_weights_are_not_compared():
    batch = _batch(skew=0.5)
    batch.batch[K.POLICY_VERSION] = torch.tensor([4, 3])  # trained at step 5: row 0 fresh, row 1 one update stale
    batch.batch[K.ROLLOUT_LOG_PROBS][0] = batch.batch[K.OLD_LOG_PROBS][0]  # only the stale row differs
    guard = ParityGuard("error", LIMITS, off_policy=True)
    metrics = guard.before_update(batch, step=5)
    assert metrics["parity/logprob_stale_rows"] == 1.0 and metrics["parity/logprob_gap_max"] == 0.0
    assert guard.before_update(batch, step=6)["parity/logprob_checked"] == 0.0  # no fresh row
    assert guard.ratio is None and ParityGuard("error", LIMITS).ratio == 0.2
    with pytest.raises(ParityError, match="'logprobs' failed at step 4"):
        guard.before_update(batch, step=4)  # row 1 fresh at step 4


def test_without_old_log_probs_the_updates_own_forward_is_checked():
    guard = ParityGuard("error", LIMITS)
    assert guard.before_update(_batch(old=False), step=2)["parity/logprob_checked"] == 0.0  # until after_update
    metrics = {"actor/parity_gap_mean": [0.001, 0.003], "actor/parity_gap_max": [0.01, 0.05], "actor/pg_loss": 1.0}
    metrics["actor/parity_frac_beyond"] = 0.0
    out = DataProto(meta_info={K.META_METRICS: metrics})
    got = guard.after_update([out], step=2)
    assert got["parity/logprob_checked"] == got["parity/logprob_in_update"] == 1.0
    assert got["parity/logprob_gap_max"] == 0.05
    assert got["parity/logprob_gap_mean"] == pytest.approx(0.002)
    assert list(out.meta_info[K.META_METRICS]) == ["actor/pg_loss"]  # reported as parity/*, not twice
    bad = DataProto(meta_info={K.META_METRICS: {**metrics, "actor/parity_gap_max": 0.7}})
    with pytest.raises(ParityError, match=r"trainer \(the update's own forward\) vs rollout .*gap_max 0.7 > 0.1"):
        guard.after_update([bad], step=2)
    assert guard.after_update([DataProto(meta_info={K.META_METRICS: {}})], step=2) == {}


def test_the_rollout_faults_break_what_they_name():
    from hybridflow.workers.actor_rollout_ref import GENERATED

    batch = _batch()
    with armed(parity="token_edit@2,logprob_skew@3"):
        GENERATED(out=batch, step=1)
        assert ParityGuard("error", LIMITS).before_update(batch, 1)["parity/token_mismatch_rows"] == 0
        GENERATED(out=batch, step=2)
        assert batch.batch[K.RESPONSES][0, 0] == 4 and batch.batch[K.INPUT_IDS][0, 3] == 4
        assert ParityGuard("warn", LIMITS).before_update(batch, 2)["parity/token_mismatch_rows"] == 1
        GENERATED(out=batch, step=3)
        assert ParityGuard("warn", LIMITS).before_update(batch, 3)["parity/logprob_gap_mean"] == pytest.approx(0.5)
    responses, log_probs = batch.batch[K.RESPONSES].clone(), batch.batch[K.ROLLOUT_LOG_PROBS].clone()
    GENERATED(out=batch, step=2)  # disarmed: the point does nothing (armed, it would edit the token again)
    GENERATED(out=batch, step=3)
    assert torch.equal(batch.batch[K.RESPONSES], responses) and torch.equal(batch.batch[K.ROLLOUT_LOG_PROBS], log_probs)


def test_config_rejects_bad_values_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.parity must be one of \['error', 'warn', 'off'\], got 'loud'"):
        load_config(RunConfig, None, ["trainer.parity=loud"])
    with pytest.raises(ConfigError, match="trainer.parity_thresholds.gap_max must be >= 0"):
        load_config(RunConfig, None, ["trainer.parity_thresholds.gap_max=-1"])
    with pytest.raises(ConfigError, match="trainer.parity_thresholds.frac_beyond is a fraction"):
        load_config(RunConfig, None, ["trainer.parity_thresholds.frac_beyond=2"])
    cfg = load_config(RunConfig, None, ["trainer.parity=warn", "trainer.parity_thresholds.gap_max=0.3"])
    limits = cfg.trainer.parity_thresholds.resolve("native", "fp32")
    assert cfg.trainer.parity == "warn" and limits.gap_max == 0.3
    assert limits.gap_mean == ParityThresholds().resolve("native", "fp32").gap_mean
    assert load_config(RunConfig, None, ["trainer.parity=off"]).trainer.parity == "off"  # not YAML's false


def test_bf16_rollout_weights_take_the_bf16_limits():
    """rollout.weight_dtype=bf16 puts an fp32 rollout's log-probs at bf16 distance from an fp32 trainer."""
    fp32 = ["rollout.dtype=fp32", "actor.engine.param_dtype=fp32"]
    exact = ParityGuard.from_config(load_config(RunConfig, None, fp32))
    rounded = ParityGuard.from_config(load_config(RunConfig, None, [*fp32, "rollout.weight_dtype=bf16"]))
    assert exact.limits == ParityThresholds().resolve("native", "fp32")
    assert rounded.limits == ParityThresholds().resolve("native", "bf16")


def test_rollout_log_probs_are_on_where_free_and_off_with_the_guard():
    assert parity_rollout_fields(RolloutConfig(name="native"), "error", False) == {"calculate_log_probs": True}
    assert parity_rollout_fields(RolloutConfig(name="native"), "off", False)["calculate_log_probs"] is False
    assert parity_rollout_fields(RolloutConfig(name="native"), "off", True)["calculate_log_probs"] is True
    assert parity_rollout_fields(RolloutConfig(name="hf", calculate_log_probs=False), "error", False) == {}


def test_a_parity_error_is_never_retried():
    err = ParityError("parity check 'weights' failed at step 2: ... gloo ...")
    assert not is_worker_failure(err, ["group g rank 1 (pid 7, node ab)"])
    in_worker = RayTaskError("update_actor", "Traceback ...", err).as_instanceof_cause()
    assert not is_worker_failure(in_worker, ["group g rank 1 (pid 7, node ab)"])


def test_off_policy_batches_carry_their_findings_through_the_queue_and_a_checkpoint(tmp_path, monkeypatch):
    from hybridflow.train import async_pipeline
    from tests.test_async_pipeline import FakeRoles, _prompts

    class Reporting(type(FakeRoles().rollout)):
        def call_nonblocking(self, method: str, prompts: DataProto, *, step: int) -> DataProto:
            out = super().call_nonblocking(method, prompts, step=step)
            out.meta_info[K.META_PARITY] = [f"sync before step {step}: lm_head differs"]
            return out

    monkeypatch.setattr(async_pipeline, "bridge_host", lambda: "127.0.0.1")
    roles = FakeRoles()
    roles.rollout = roles.actor_rollout.rollout = Reporting(roles.log)
    pipe = async_pipeline.AsyncRollout(roles, _prompts(), 4, 1, wait=lambda refs: refs)
    pipe.start(0, None, {})
    assert pipe.batch(1).meta_info[K.META_PARITY] == ["sync before step 1: lm_head differs"]
    state = pipe.save(tmp_path)  # step 2's batch, generated ahead, goes through the checkpoint
    resumed = async_pipeline.AsyncRollout(roles, _prompts(2), 4, 1, wait=lambda refs: refs)
    resumed.start(1, tmp_path, state)
    batch = resumed.batch(2)
    with pytest.raises(ParityError, match="'weights' failed at step 2: sync before step 2: lm_head differs"):
        ParityGuard("error", LIMITS).before_update(batch, step=2)


def test_the_updates_own_forward_measures_the_gaps_of_its_micro_batch():
    from hybridflow.workers.config import ActorConfig
    from hybridflow.workers.losses import actor_loss_builder
    from hybridflow.workers.ppo_update import global_norm

    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    rollout = torch.tensor([[-1.1, -2.0, -1.5], [-0.3, -0.5, -1.0]])
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -9.0]], requires_grad=True)
    micro = {K.RESPONSE_MASK: mask, K.ADVANTAGES: torch.ones(2, 3), K.ROLLOUT_LOG_PROBS: rollout}
    outputs = {"log_probs": log_probs, "entropy": torch.zeros(2, 3)}
    build = actor_loss_builder(ActorConfig(ppo_mini_batch_size=2), own_old_log_prob=True, parity_ratio=0.2)
    _, metrics = build(global_norm(mask))(outputs, micro)
    assert metrics["parity_gap_mean"] == pytest.approx(0.1, abs=1e-6)  # as test_logprob_gaps_match_...
    assert metrics["parity_gap_max"] == pytest.approx(0.3, abs=1e-6) and metrics["parity_frac_beyond"] == 0.25
    unasked = actor_loss_builder(ActorConfig(ppo_mini_batch_size=2), own_old_log_prob=True)(global_norm(mask))
    assert "parity_gap_mean" not in unasked(outputs, micro)[1]
    # actor.old_log_prob=rollout: the rows' old log-probs are the rollout's; the first optimizer step's forward
    # (on the weights that generated) is measured, the later ones are not
    micro[K.OLD_LOG_PROBS] = rollout
    from_rollout = actor_loss_builder(ActorConfig(ppo_mini_batch_size=2, old_log_prob="rollout"), parity_ratio=0.2)
    first, second = from_rollout(global_norm(mask)), from_rollout(global_norm(mask))
    measured, unmeasured = first(outputs, micro)[1], second(outputs, micro)[1]
    assert measured["parity_gap_max"] == pytest.approx(0.3, abs=1e-6)
    assert measured["rollout_probs_diff_mean"] > 0  # the forward's probabilities, not the rollout's against themselves
    assert "parity_gap_mean" not in unmeasured and "rollout_probs_diff_mean" not in unmeasured


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_rollouts_hash_the_ids_they_sample(backend: str):
    from rollout_helpers import add_eos_bias, prompt_batch, tiny

    from hybridflow.rollout.config import SamplingParams
    from hybridflow.rollout.hf import HFRollout
    from hybridflow.rollout.native.rollout import NativeRollout

    model, tok = tiny()
    add_eos_bias(
        model, tok.eos_token_id, 10.0
    )  # P(EOS) about 0.3 per step: rows end at different lengths (native: finished rows compacted)
    cfg = RolloutConfig(
        name="hf" if backend == "hf" else "native", dtype="fp32", response_length=10, calculate_log_probs=True
    )
    rollout = (
        HFRollout(cfg, model, tok)
        if backend == "hf"
        else NativeRollout(cfg, model, tok, use_static=backend == "native")
    )
    out = rollout.generate_sequences(prompt_batch(tok), SamplingParams(temperature=1.0, n=3))
    b = out.batch
    assert 0 < int(b[K.RESPONSE_MASK].sum()) < b[K.RESPONSE_MASK].numel()  # some rows stopped early
    assert torch.equal(b[K.SAMPLED_IDS_HASH], hash_rows(b[K.RESPONSES], b[K.RESPONSE_MASK]))
