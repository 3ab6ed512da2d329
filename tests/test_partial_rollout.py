"""Partial rollout (trainer.partial_rollout, hybridflow/rollout/partial.py): a weight update lands in the middle of
a multi-turn trajectory on a real rollout; the trained ids are the sampled ids, every token carries the version
that sampled it, and every token's rollout log-prob is its own version's (teacher-forced under each weight set).
Also the push watch over a real store, and the config checks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from hybridflow.agent.loop.batch import trajectories_to_batch
from hybridflow.agent.loop.env import Environment, ResetResult, StepResult
from hybridflow.agent.loop.runner import AgentLoopConfig, run_agent_loop
from hybridflow.config.run import RunConfig
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.protocol import keys as K
from hybridflow.protocol.token_hash import mismatched_rows
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.base import load_state_dict_into
from hybridflow.rollout.bridge import WeightBridge, announced, open_store, store_client
from hybridflow.rollout.config import SamplingParams
from hybridflow.rollout.partial import PushWatch, fill_versions, generate_turnwise, resumable, versioned
from hybridflow.utils.config_loader import load_config
from tests.test_agent_rollout import runs, stopping_model

TURN_TOKENS = 8


class ThreeTurns(Environment):
    """A tool reply after each of the first two turns; done after the third."""

    def __init__(self) -> None:
        self.seen = 0

    def reset(self, row):
        return ResetResult([{"role": "user", "content": row["q"]}])

    def step(self, text):
        self.seen += 1
        if self.seen >= 3:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": f"result {self.seen}"}])


def teacher_forced(model, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= start under `model`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])][start - 1 :]


@pytest.mark.parametrize("name", ["native", pytest.param("hf", marks=pytest.mark.slow)])
def test_an_update_landing_mid_turn_keeps_ids_versions_and_log_probs_exact(tmp_path: Path, name: str):
    model_path, _ = stopping_model(tmp_path)
    tok = load_tokenizer(model_path)
    cfg = RolloutConfig(name=name, dtype="fp32", prompt_length=64, response_length=48, calculate_log_probs=True)
    rollout = build_rollout(cfg, model_path, tok)
    before = {k: v.detach().clone() for k, v in rollout.held_weights().items()}
    gen = torch.Generator().manual_seed(1)
    after = {k: v + 0.5 * torch.randn(v.shape, generator=gen) * v.std() for k, v in before.items()}
    version, pending, calls = [0], [False], [0]

    def take_push() -> bool:  # what the worker does when the actor's push was announced (workers: _take_push)
        taken = pending[0]
        if taken:
            rollout.load_weights(after)
            version[0], pending[0] = 1, False
        rollout.interrupted.clear()
        return taken

    with rollout.turn_generator(SamplingParams(), interruptible=True) as inner:

        def landing(batch, budgets):
            calls[0] += 1
            if calls[0] == 2:  # the update lands as round 2 starts: every row keeps one token of version 0
                pending[0] = True
                rollout.interrupted.set()
            return inner(batch, budgets)

        generate = resumable(landing, rollout.eos_ids, rollout.interrupted, take_push, lambda: version[0])
        loop = AgentLoopConfig(response_length=48, max_turn_tokens=TURN_TOKENS, max_assistant_turns=3)
        rows = [{"q": f"question {i}" + " more" * i} for i in range(4)]
        trajs = run_agent_loop(rows, ThreeTurns, generate, tok, loop, rollout.eos_ids)

    out = trajectories_to_batch(trajs, rollout.pad_id, 64, 48)
    b = out.batch
    assert mismatched_rows(b[K.SAMPLED_IDS_HASH], b[K.RESPONSES], b[K.RESPONSE_MASK]) == []
    switched, apart = 0, 0.0
    scorer = load_causal_lm(model_path).eval()
    forced_by_version = []
    for weights in (before, after):
        load_state_dict_into(scorer, weights)
        forced_by_version.append(
            [teacher_forced(scorer, t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in trajs]
        )
    for k, t in enumerate(trajs):
        assert [i for i, m in zip(t.response_ids, t.response_mask) if m] == t.sampled_ids
        turns = [len(ids) for m, ids in runs(t.response_ids, t.response_mask) if m == 1]
        expected = [0] * turns[0]
        if len(turns) > 1:  # turn 2: one token before the update, the rest after it
            expected += [0] + [1] * (turns[1] - 1)
            switched += turns[1] > 1
        expected += [1] * sum(turns[2:])
        assert [v for v, m in zip(t.token_versions, t.response_mask) if m] == expected
        assert all(v == -1 for v, m in zip(t.token_versions, t.response_mask) if not m)
        logps = torch.tensor(t.rollout_log_probs)
        forced = [forced_by_version[0][k], forced_by_version[1][k]]
        model_tokens = torch.tensor(t.response_mask).bool()
        for v in (0, 1):
            own = model_tokens & (torch.tensor(t.token_versions) == v)
            torch.testing.assert_close(logps[own], forced[v][own], atol=2e-4, rtol=0)
        later = model_tokens & (torch.tensor(t.token_versions) == 1)
        if later.any():
            apart = max(apart, float((logps[later] - forced[0][later]).abs().max()))
    assert switched >= 1, [t.stop_reason for t in trajs]
    assert apart > 0.05  # the other weights give other numbers: the check above tells the versions apart
    assert torch.equal(
        b[K.TOKEN_POLICY_VERSION][0, : len(trajs[0].token_versions)], torch.tensor(trajs[0].token_versions)
    )


def test_single_turn_rows_take_an_update_mid_generation_in_the_rollout_layout(tmp_path: Path):
    """generate_turnwise + resumable: the update lands after each row's first token; the rows keep the standard
    layout, trained ids are the sampled ids, versions 0 then 1, log-probs their own version's."""
    from tests.rollout_helpers import prompt_batch

    model_path, _ = stopping_model(tmp_path)
    tok = load_tokenizer(model_path)
    cfg = RolloutConfig(dtype="fp32", prompt_length=64, response_length=12, calculate_log_probs=True)
    rollout = build_rollout(cfg, model_path, tok)
    before = {k: v.detach().clone() for k, v in rollout.held_weights().items()}
    gen = torch.Generator().manual_seed(2)
    after = {k: v + 0.5 * torch.randn(v.shape, generator=gen) * v.std() for k, v in before.items()}
    version = [0]

    def take_push() -> bool:
        taken = version[0] == 0 and rollout.interrupted.is_set()
        if taken:
            rollout.load_weights(after)
            version[0] = 1
        rollout.interrupted.clear()
        return taken

    def wrap(inner):
        def landing(batch, budgets):
            if version[0] == 0:
                rollout.interrupted.set()  # the update lands as the generation starts
            return inner(batch, budgets)

        return resumable(landing, rollout.eos_ids, rollout.interrupted, take_push, lambda: version[0])

    prompts = prompt_batch(tok)
    out = generate_turnwise(rollout, prompts, SamplingParams(n=2), wrap)
    b = out.batch
    assert len(out) == 2 * len(prompts) and b[K.RESPONSES].shape[1] == 12
    assert list(out.non_tensor_batch["uid"]) == [u for u in prompts.non_tensor_batch["uid"] for _ in range(2)]
    assert mismatched_rows(b[K.SAMPLED_IDS_HASH], b[K.RESPONSES], b[K.RESPONSE_MASK]) == []
    mask = b[K.RESPONSE_MASK].bool()
    versions = b[K.TOKEN_POLICY_VERSION]
    assert bool((versions[:, 0] == 0).all()) and bool((versions[:, 1:][mask[:, 1:]] == 1).all())
    assert bool((versions[~mask] == -1).all()) and int(mask[:, 1:].sum()) > 0
    scorer = load_causal_lm(model_path).eval()
    for weights, v in ((before, 0), (after, 1)):
        load_state_dict_into(scorer, weights)
        for row in range(len(out)):
            real = b[K.ATTENTION_MASK][row].bool()
            ids = b[K.INPUT_IDS][row][real].tolist()
            start = int(real[: -b[K.RESPONSES].shape[1]].sum())
            forced = teacher_forced(scorer, ids, start)
            own = (versions[row] == v)[mask[row]]
            got = b[K.ROLLOUT_LOG_PROBS][row][mask[row]]
            torch.testing.assert_close(got[own], forced[own], atol=2e-4, rtol=0)


def test_versioned_stamps_each_round_and_fill_versions_completes_a_batch():
    from hybridflow.agent.loop.runner import TurnOutput

    held = [3]

    def generate(batch, budgets):
        return [TurnOutput([7] * len(ids), None) for ids in batch]

    outs = versioned(generate, lambda: held[0])([[1, 2], [1]], [4, 4])
    assert [o.versions for o in outs] == [[3, 3], [3]]
    from hybridflow.protocol import DataProto

    batch = DataProto.from_dict(
        {
            K.RESPONSE_MASK: torch.tensor([[1, 1, 0], [1, 0, 0]]),
            K.TOKEN_POLICY_VERSION: torch.tensor([[2, -1, -1], [-1, -1, -1]]),
        }
    )
    fill_versions(batch, 5)
    assert batch.batch[K.TOKEN_POLICY_VERSION].tolist() == [[2, 5, -1], [5, -1, -1]]


def test_the_push_watch_interrupts_once_a_newer_push_is_announced():
    store, port = open_store("127.0.0.1", 2, 30.0)
    joined: list = []
    peer = threading.Thread(target=lambda: joined.append(WeightBridge("127.0.0.1", port, 1, 2, 30.0)))
    peer.start()
    sender = WeightBridge("127.0.0.1", port, 0, 2, 30.0, store=store)
    peer.join(timeout=30)
    client = store_client("127.0.0.1", port, 30.0)
    assert announced(client) is None and joined[0].announced() is None
    event, held = threading.Event(), [4]
    with PushWatch(lambda: announced(client), lambda: held[0], event, period_s=0.005):
        sender.announce(4)  # the weights already held: nothing to take
        time.sleep(0.1)
        assert not event.is_set()
        sender.announce(5)
        assert event.wait(timeout=10)
        assert joined[0].announced() == 5
        held[0] = 5
        event.clear()
        time.sleep(0.1)
        assert not event.is_set()
    assert not event.is_set()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.partial_rollout=true"], "set trainer.mode=one_step_off or async"),
        (
            [
                "trainer.partial_rollout=true",
                "trainer.mode=one_step_off",
                "trainer.placement=split",
                "trainer.n_workers_per_node=4",
                "rollout.tensor_model_parallel_size=2",
            ],
            "a tensor-parallel rollout is not interrupted",
        ),
        (
            [
                "trainer.partial_rollout=true",
                "trainer.mode=one_step_off",
                "trainer.placement=split",
                "rollout.multi_turn.enable=true",
                "rollout.name=vllm",
            ],
            "only the native and hf rollouts",
        ),
    ],
)
def test_bad_partial_rollout_configs_are_refused_at_load(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(RunConfig, None, overrides)


class FakeRollout:
    """The rollout group: step 2's first row takes push 1 after its first two tokens."""

    world_size = 1

    def __init__(self, log: list) -> None:
        self.log = log

    def call_nonblocking(self, method, prompts, *, step, partial):
        from hybridflow.protocol import DataProto

        self.log.append(("gen", step, partial))
        late = 1 if step == 2 else 0
        versions = torch.tensor([[0, 0, late, -1], [0, 0, 0, -1]])
        return DataProto.from_dict({K.RESPONSE_MASK: (versions >= 0).long(), K.TOKEN_POLICY_VERSION: versions})

    def join_weight_bridge(self, *args):
        return []

    def transfer_weights(self, step):
        return [("receiver", step)]


class FakeActor:
    world_size = 1

    def open_weight_bridge(self, host, world):
        return [(host, 1, [])]

    def join_weight_bridge(self, *args):
        return []

    def transfer_weights(self, step):
        return [("sender", step)]


def partial_pipeline(monkeypatch, staleness: int, log: list):
    """AsyncRollout(partial=True) over the fakes; `log` gets the generations issued and the calls waited for."""
    from hybridflow.protocol import DataProto
    from hybridflow.train import async_pipeline
    from hybridflow.train.async_pipeline import AsyncRollout

    monkeypatch.setattr(async_pipeline, "bridge_host", lambda: "127.0.0.1")

    def wait(refs):
        if not refs:
            return []
        side, step = refs[0]
        log.append(("wait", side, step))
        if side == "sender":
            return [{"timing_s/weight_transfer": 0.5, "weight_transfer/bytes": 8.0}]
        return [{"timing_s/weight_transfer": 2.0, K.META_PARITY: [f"finding of push {step}"]}]

    class Roles:
        rollout, actor_rollout = FakeRollout(log), FakeActor()

    prompts = iter(DataProto.from_dict({"p": torch.tensor([i, i])}) for i in range(10))
    pipe = AsyncRollout(Roles(), prompts, 4, staleness, wait=wait, partial=True)
    pipe.start(0, None, {})
    return pipe


def test_the_pipeline_issues_partial_generations_and_waits_for_each_push_at_the_next_batch(monkeypatch):
    """AsyncRollout(partial=True) against fake groups: the generations are issued with partial=True, the push's
    rollout-side call is waited for with the next batch (the sender's only in the push), its findings reach that
    batch, and the staleness metrics are per token (a row of step 2 holds tokens of versions 0 and 1)."""
    log: list = []
    pipe = partial_pipeline(monkeypatch, 1, log)
    first = pipe.batch(1)
    m1 = pipe.after_update(1, first)
    assert ("wait", "sender", 1) in log and ("wait", "receiver", 1) not in log
    assert "timing_s/weight_transfer_receive" not in m1 and m1["async/partial_rows"] == 0.0
    second = pipe.batch(2)
    assert log.index(("wait", "receiver", 1)) > log.index(("gen", 3, True))
    assert second.meta_info[K.META_PARITY] == ["finding of push 1"]
    assert second.batch[K.POLICY_VERSION].tolist() == [0, 0]
    m2 = pipe.after_update(2, second)
    assert m2["timing_s/weight_transfer_receive"] == 2.0 and m2["async/partial_rows"] == 0.5
    assert m2["async/staleness_hist/0"] == pytest.approx(1 / 6) and m2["async/staleness/max"] == 1.0
    assert [e for e in log if e[0] == "gen"] == [("gen", 1, True), ("gen", 2, True), ("gen", 3, True)]


def test_with_staleness_2_a_push_is_waited_for_after_the_generations_issued_before_it(monkeypatch):
    """Push 1 is issued while steps 2 and 3 are queued: its rollout-side call returns after step 3's generation,
    so the controller waits for it at batch(3), not at batch(2) (which would wait for step 3's generation)."""
    log: list = []
    pipe = partial_pipeline(monkeypatch, 2, log)
    pipe.after_update(1, pipe.batch(1))
    pipe.batch(2)
    assert ("wait", "receiver", 1) not in log
    third = pipe.batch(3)
    assert ("wait", "receiver", 1) in log and third.meta_info[K.META_PARITY] == ["finding of push 1"]


def test_the_native_turn_engine_stamps_every_token_with_the_held_version(tmp_path: Path):
    """Outside partial rollout the native rollout's turn engine (KV kept across turns) runs the loop; `versioned`
    stamps its turns as a round path's, and `interruptible=True` gives the round path a push may cut."""
    from hybridflow.agent.loop.runner import TurnEngine

    model_path, _ = stopping_model(tmp_path)
    tok = load_tokenizer(model_path)
    cfg = RolloutConfig(dtype="fp32", prompt_length=64, response_length=48, calculate_log_probs=True)
    rollout = build_rollout(cfg, model_path, tok)
    with rollout.turn_generator(SamplingParams(), interruptible=True) as rounds:
        assert not isinstance(rounds, TurnEngine)
    with rollout.turn_generator(SamplingParams()) as engine:
        assert isinstance(engine, TurnEngine), "the fused decode step covers the tiny llama: the engine path"
        loop = AgentLoopConfig(response_length=48, max_turn_tokens=TURN_TOKENS, max_assistant_turns=3)
        rows = [{"q": f"question {i}"} for i in range(3)]
        trajs = run_agent_loop(rows, ThreeTurns, versioned(engine, lambda: 7), tok, loop, rollout.eos_ids)
    for t in trajs:
        assert [i for i, m in zip(t.response_ids, t.response_mask) if m] == t.sampled_ids
        assert all(v == (7 if m else -1) for v, m in zip(t.token_versions, t.response_mask))
        assert sum(t.response_mask) > 0
