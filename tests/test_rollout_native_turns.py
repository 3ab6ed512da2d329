"""The native rollout's turn engine (rollout/native/turns.py) under the agent loop: the KV cache kept across turns
gives the samples of re-running every context, each rejoining turn runs only its new ids, and a slow tool delays
only its own trajectory."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from hybridflow.agent.loop.env import Environment, ResetResult
from hybridflow.agent.loop.runner import AgentLoopConfig, BatchTurns, run_agent_loop
from hybridflow.agent.loop.tokens import observation_ids
from hybridflow.models import load_tokenizer
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.base import ModuleRollout
from hybridflow.rollout.config import SamplingParams
from hybridflow.rollout.native import panel
from tests.test_agent_rollout import Echo, stopping_model

pytestmark = pytest.mark.skipif(
    panel.kernel(panel.DECODE_STEP) is None, reason="the turn engine needs the fused decode step (C compiler, AVX2)"
)

ROWS = [{"prompt": [{"role": "user", "content": f"question {i}" + " more" * (3 * i)}]} for i in range(5)]
LOOP = AgentLoopConfig(response_length=64, max_turn_tokens=12)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny random model with ~10k stop ids (turns end within a few sampled tokens) and its tokenizer."""
    path, stops = stopping_model(tmp_path_factory.mktemp("native_turns"))
    return path, stops, load_tokenizer(path)


def rollout(model, max_batch_size: int = 8):
    path, _, tok = model
    config = RolloutConfig(
        name="native", prompt_length=64, response_length=64, dtype="fp32", seed=7, max_batch_size=max_batch_size
    )
    return build_rollout(config, path, tok)


def run(model, engine, rows=ROWS, env=Echo, ro=None, loop=LOOP):
    return run_agent_loop(rows, env, engine, model[2], loop, ro.eos_ids if ro else model[1])


def same_samples(a, b, atol: float = 1e-4) -> None:
    """Equal trajectories: ids, masks, turns; log-probs equal to fp32 rounding."""
    for x, y in zip(a, b, strict=True):
        assert (x.response_ids, x.response_mask, x.stop_reason) == (y.response_ids, y.response_mask, y.stop_reason)
        assert x.sampled_ids == y.sampled_ids
        assert max((abs(p - q) for p, q in zip(x.rollout_log_probs, y.rollout_log_probs)), default=0.0) <= atol


@pytest.mark.parametrize("sampling", [SamplingParams(do_sample=False), SamplingParams(temperature=1.0)])
def test_kv_reuse_samples_what_rerunning_every_context_samples(model, sampling):
    ro = rollout(model)
    ro.reseed(1)
    kept = run(model, ro.turn_engine(sampling), ro=ro)
    ro.reseed(1)
    rerun = run(model, ro.turn_engine(sampling, reuse_kv=False), ro=ro)
    same_samples(kept, rerun)
    if sampling.do_sample:  # a real multi-turn episode (greedy on the random model repeats one id to the budget)
        assert max(t.assistant_turns for t in kept) >= 3, [t.stop_reason for t in kept]
    else:  # greedy: what the round path (one generate_sequences per round, every context re-run) samples too
        with ModuleRollout.turn_generator(ro, sampling) as generate:
            same_samples(kept, run(model, BatchTurns(generate), ro=ro))


def test_each_later_turn_runs_only_its_stop_id_and_observation(model):
    """Every context id run into the cache after the first turn: the turn's stop id, then Echo's reply."""
    ro = rollout(model)
    ro.reseed(2)
    engine = ro.turn_engine(SamplingParams(temperature=1.0))
    ran: list[tuple[int, list[int], int]] = []
    extend = engine.dec.extend

    def recording(slots, ids, starts):
        ran.extend(zip(slots, ids, starts))
        return extend(slots, ids, starts)

    engine.dec.extend = recording
    trajs = run(model, engine, ro=ro)
    # the prompts: their shared first ids once, then each one's own
    first = [r for r in ran if any(t.prompt_ids[r[2] : r[2] + len(r[1])] == r[1] for t in trajs)]
    later = [r for r in ran if r not in first]
    assert len(first) == len(trajs) + 1 and len(later) == sum(t.user_turns for t in trajs) >= 5
    obs = [observation_ids(model[2], [{"role": "tool", "content": f"obs {k}"}], model[1]) for k in (1, 2)]
    assert all(ids[0] in model[1] and ids[1:] in obs for _, ids, _ in later)


def test_samples_do_not_depend_on_who_shares_the_batch(model):
    """At most two rows decoding at once (rollout.max_batch_size), slots reused as trajectories end: the same
    samples as all five together."""
    sampling = SamplingParams(temperature=1.0)
    ro = rollout(model, 8)
    ro.reseed(3)
    wide = run(model, ro.turn_engine(sampling), ro=ro)
    ro.config = dataclasses.replace(ro.config, max_batch_size=2)
    ro.reseed(3)
    same_samples(wide, run(model, ro.turn_engine(sampling), ro=ro))


class Gate:
    """Row 0's first tool call blocks until every other trajectory's environment has said done."""

    def __init__(self, others: int) -> None:
        self.others, self.finished, self.lock = others, 0, threading.Lock()
        self.all_others_done = threading.Event()
        self.events: list[str] = []

    def env(self) -> Environment:
        gate = self

        class Gated(Echo):
            def reset(self, row):
                self.slow = row.get("slow", False)
                return ResetResult(list(row["prompt"]))

            def step(self, text):
                if self.slow and self.seen == 0:
                    gate.events.append("slow tool started")
                    released = gate.all_others_done.wait(timeout=120)  # a loop in rounds never releases it
                    gate.events.append("slow tool returned" + ("" if released else " (timed out)"))
                result = super().step(text)
                if result.done and not self.slow:
                    with gate.lock:
                        gate.finished += 1
                        gate.events.append("other done")
                        if gate.finished == gate.others:
                            gate.all_others_done.set()
                return result

        return Gated()


def test_a_slow_tool_delays_only_its_own_trajectory(model):
    ro = rollout(model)
    sampling = SamplingParams(temperature=1.0)
    rows = [{**row, "slow": i == 0} for i, row in enumerate(ROWS[:4])]
    loop = AgentLoopConfig(response_length=160, max_turn_tokens=40)  # long enough that every turn stops on its own
    ro.reseed(4)
    free = run(model, ro.turn_engine(sampling), rows, Echo, ro, loop)
    assert [t.stop_reason for t in free] == ["done"] * 4  # every trajectory calls the tool, so row 0 waits
    gate = Gate(others=3)
    ro.reseed(4)
    gated = run(model, ro.turn_engine(sampling), rows, gate.env, ro, loop)
    assert gate.events[0] == "slow tool started"
    assert gate.events[-1] == "slow tool returned", gate.events  # the others finished while it was blocked
    assert gate.events.count("other done") == 3
    same_samples(gated, free)  # and each trajectory sampled what it samples when no tool waits
