"""Multi-turn is a capability of the `Rollout` interface: a plugin rollout that is no `ModuleRollout` runs the agent
loop by implementing `turn_generator` (a round function or a turn engine), with trained ids equal to the sampled ones;
one that does not fails naming its class."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_agent_rollout import Echo, prompts

from hybridflow.agent.config import MultiTurnConfig
from hybridflow.agent.loop.runner import TurnOutput
from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.protocol import keys as K
from hybridflow.protocol.token_hash import mismatched_rows
from hybridflow.rollout import Rollout, RolloutConfig, SamplingParams
from hybridflow.rollout.multi_turn import generate_multi_turn

REPLY = "hello there"
LOGP = -0.5


class Scripted(Rollout):
    """Answers every turn with REPLY then EOS, each sampled token at log-prob LOGP; records each call's budgets."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = [tokenizer.eos_token_id]
        self.pad_id = tokenizer.pad_token_id
        self.budgets: list[list[int]] = []

    def generate_sequences(self, prompts, sampling=None):
        raise AssertionError("the agent loop generates through turn_generator only")

    def load_weights(self, state_dict, partial=False):
        pass

    def reseed(self, step):
        pass

    def turn_generator(self, sampling):
        reply = self.tokenizer.encode(REPLY, add_special_tokens=False) + self.eos_ids

        def generate(batch: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
            self.budgets.append(list(budgets))
            return [TurnOutput(reply[:b], [LOGP] * min(b, len(reply))) for b in budgets]

        return contextlib.nullcontext(generate)


class Unsupported(Scripted):
    turn_generator = Rollout.turn_generator


def config() -> RolloutConfig:
    env = f"{Echo.__module__}:Echo"
    return RolloutConfig(
        n=2, prompt_length=64, response_length=48, multi_turn=MultiTurnConfig(enable=True, env=env, max_turn_tokens=10)
    )


def test_a_plugin_rollout_runs_the_agent_loop_through_turn_generator():
    tok = load_tokenizer(tiny_model_dir("llama"))
    rollout = Scripted(tok)
    out = generate_multi_turn(rollout, prompts(tok), SamplingParams(n=2), config())
    b = out.batch
    assert len(out) == 6 and list(out.non_tensor_batch[K.NUM_TURNS]) == [3] * 6  # Echo ends after 3 turns
    assert mismatched_rows(b[K.SAMPLED_IDS_HASH], b[K.RESPONSES], b[K.RESPONSE_MASK]) == []
    reply = tok.encode(REPLY, add_special_tokens=False) + [tok.eos_token_id]
    for row in range(len(out)):
        mask = b[K.RESPONSE_MASK][row].bool()
        assert b[K.RESPONSES][row][mask].tolist() == reply * 3  # the sampled ids, each turn's, in order
        assert torch.all(b[K.ROLLOUT_LOG_PROBS][row][mask] == LOGP)
        assert int((~mask[: int(b[K.ATTENTION_MASK][row, 64:].sum())]).sum()) > 0  # observations, not trained
    assert rollout.budgets[0] == [10] * 6  # max_turn_tokens, every trajectory in one call per round


def test_a_rollout_without_turn_generator_fails_naming_its_class():
    tok = load_tokenizer(tiny_model_dir("llama"))
    with pytest.raises(NotImplementedError, match="Unsupported does not implement Rollout.turn_generator"):
        generate_multi_turn(Unsupported(tok), prompts(tok), SamplingParams(n=2), config())


class EngineRollout(Scripted):
    """Gives a continuous `TurnEngine`: one token of REPLY + EOS per `advance` for every queued turn."""

    def turn_generator(self, sampling):
        self.engine = ScriptedEngine(self.tokenizer.encode(REPLY, add_special_tokens=False) + self.eos_ids)
        return contextlib.nullcontext(self.engine)


class ScriptedEngine:
    """Records the contexts each trajectory was submitted with, and the releases."""

    continuous = True

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.pending, self.contexts, self.released = reply, {}, {}, []

    def submit(self, key, context, budget):
        self.contexts.setdefault(key, []).append(list(context))
        self.pending[key] = []

    def advance(self):
        ended = []
        for key, ids in list(self.pending.items()):
            ids.append(self.reply[len(ids)])
            if len(ids) == len(self.reply):
                ended.append((key, TurnOutput(self.pending.pop(key), [LOGP] * len(ids))))
        return ended

    def release(self, key):
        self.released.append(key)


def test_a_plugin_turn_engine_gets_each_trajectory_by_key_with_its_growing_context():
    tok = load_tokenizer(tiny_model_dir("llama"))
    rollout = EngineRollout(tok)
    out = generate_multi_turn(rollout, prompts(tok), SamplingParams(n=2), config())
    b = out.batch
    reply = tok.encode(REPLY, add_special_tokens=False) + [tok.eos_token_id]
    assert list(out.non_tensor_batch[K.NUM_TURNS]) == [3] * 6
    assert mismatched_rows(b[K.SAMPLED_IDS_HASH], b[K.RESPONSES], b[K.RESPONSE_MASK]) == []
    engine = rollout.engine
    assert sorted(engine.released) == list(range(6))  # each trajectory released once, when it ended
    for key, contexts in engine.contexts.items():
        assert len(contexts) == 3
        for before, after in zip(contexts, contexts[1:]):  # the last context, the turn, then the observation
            assert after[: len(before) + len(reply)] == before + reply and len(after) > len(before) + len(reply)
        assert b[K.RESPONSES][key][b[K.RESPONSE_MASK][key].bool()].tolist() == reply * 3
