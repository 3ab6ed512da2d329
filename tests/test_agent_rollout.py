"""Multi-turn rollouts in the worker (rollout.multi_turn): sampled ids kept, observations masked, log-probs
matching the trainer's, observation tokens out of the loss, and the config checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.agent.config import MultiTurnConfig
from hybridflow.agent.loop.env import Environment, ResetResult, StepResult
from hybridflow.agent.loop.tokens import observation_ids
from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.engine import EngineConfig
from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.protocol.token_hash import mismatched_rows
from hybridflow.rollout import RolloutConfig
from hybridflow.workers import ActorConfig, ActorRolloutRefWorker, ModelConfig, RefConfig
from hybridflow.workers.losses import actor_loss_builder
from hybridflow.workers.ppo_update import global_norm

ENV = f"{__name__}:Echo"


class Echo(Environment):
    """Replies to each turn with a tool message; ends after 3 turns with reward 1 (0.25 per earlier turn)."""

    def __init__(self) -> None:
        self.seen = 0

    def reset(self, row):
        return ResetResult(list(row["prompt"]))

    def step(self, assistant_text):
        self.seen += 1
        if self.seen >= 3:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": f"obs {self.seen}"}], reward=0.25, info={"tool_calls": 1})


def stopping_model(tmp: Path, source: Path | None = None) -> tuple[str, list[int]]:
    """The tiny random model (or the one at `source`) with ~10k extra EOS ids in its generation config, so that
    its turns end within a few tokens (ids the chat template uses are left out, so turn ends stay unambiguous)."""
    path = tmp / "model"
    shutil.copytree(source or tiny_model_dir("llama"), path)
    tok = load_tokenizer(path)
    dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    used = set(tok.apply_chat_template(dummy, tokenize=True)["input_ids"])
    stops = [tok.eos_token_id] + [i for i in range(20000, 30000) if i not in used]
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": stops}))
    return str(path), stops


def worker(model: str, env: str = ENV, name: str = "native") -> LocalWorkerGroup:
    rollout = RolloutConfig(
        name=name,
        n=2,
        prompt_length=64,
        response_length=48,
        dtype="fp32",
        calculate_log_probs=True,
        multi_turn=MultiTurnConfig(enable=True, env=env, max_turn_tokens=10),
    )
    actor = ActorConfig(
        ppo_mini_batch_size=4, ppo_micro_batch_size_per_device=4, engine=EngineConfig(param_dtype="fp32")
    )
    group = LocalWorkerGroup(
        None,
        ClassWithInitArgs(ActorRolloutRefWorker, ModelConfig(path=model), actor, rollout, RefConfig(), "actor_rollout"),
    )
    group.init_model()
    return group


def prompts(tok, count: int = 3, width: int = 64) -> DataProto:
    chats = [[{"role": "user", "content": f"question {i}" + " more" * i}] for i in range(count)]
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"] for c in chats]
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    columns = {
        K.RAW_PROMPT: chats,
        K.DATA_SOURCE: ["echo"] * count,
        K.GROUND_TRUTH: ["1"] * count,
        K.EXTRA_INFO: [{"i": i} for i in range(count)],
        K.UID: [f"u{i}" for i in range(count)],
    }
    non_tensors = {k: np.array(v + [None], dtype=object)[:-1] for k, v in columns.items()}
    tensors = {K.INPUT_IDS: input_ids, K.ATTENTION_MASK: mask, K.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0)}
    return DataProto.from_dict(tensors, non_tensors)


def runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(mask value, ids) runs of one response."""
    out: list[tuple[int, list[int]]] = []
    for token, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(token)
        else:
            out.append((m, [token]))
    return out


@pytest.fixture(scope="module", params=["native", "hf"])
def generated(request, tmp_path_factory):
    """A worker, its multi-turn output for 3 prompts x 2 samples, and every turn its rollout sampled."""
    model, stops = stopping_model(tmp_path_factory.mktemp("agent_rollout"))
    group = worker(model, name=request.param)
    rollout, sampled = group._worker.rollout, []
    if request.param == "native":  # the turn engine: turns recorded by trajectory as they end
        sampled = {}
        make_engine = rollout.turn_engine

        def recording_engine(sampling, reuse_kv=True):
            engine = make_engine(sampling, reuse_kv)
            advance = engine.advance

            def recording():
                turns = advance()
                for key, turn in turns:
                    sampled.setdefault(key, []).append(list(turn.token_ids))
                return turns

            engine.advance = recording
            return engine

        rollout.turn_engine = recording_engine
    else:
        plain = rollout.generate_sequences

        def recording(batch, sampling=None):
            out = plain(batch, sampling)
            sampled.append(
                [r[: int(m.sum())].tolist() for r, m in zip(out.batch[K.RESPONSES], out.batch[K.RESPONSE_MASK])]
            )
            return out

        rollout.generate_sequences = recording
    tok = load_tokenizer(model)
    out = group.generate_sequences(prompts(tok), step=1)
    vars(rollout).pop("generate_sequences", None)
    vars(rollout).pop("turn_engine", None)
    return group, tok, stops, out, sampled


def test_multi_turn_batch_holds_the_sampled_ids_and_masks_the_observations(generated):
    _, tok, stops, out, sampled = generated
    assert_the_sampled_turns_are_trained(out, tok, stops, sampled)


def assert_the_sampled_turns_are_trained(
    out: DataProto, tok, stops: list[int], sampled: list[list[list[int]]] | dict[int, list[list[int]]]
):
    """`out` (3 prompts x 2 samples of Echo, responses 48 wide) holds, as its trained tokens, exactly the ids the
    rollout sampled (`sampled`: each generate call's turns, one id list per running row; or, from a turn engine,
    each row's turns in order), between Echo's replies as the template renders them (response_mask 0); the rewards
    sit on model tokens."""
    b = out.batch
    assert len(out) == 6 and list(out.non_tensor_batch[K.UID]) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert b[K.ATTENTION_MASK][:, -48:].sum() > b[K.RESPONSE_MASK].sum()  # observations: real, not trained
    turns = out.non_tensor_batch[K.NUM_TURNS]
    assert max(turns) >= 2, out.non_tensor_batch[K.STOP_REASON]
    # the model turns of row r are, in order, what the rollout sampled for it in the rounds it was running
    pending = {r: [] for r in range(6)}
    running = list(range(6))
    if isinstance(sampled, dict):
        pending, sampled = {r: sampled[r] for r in range(6)}, []
    for call in sampled:
        assert len(call) == len(running)
        for row, ids in zip(running, call):
            pending[row].append(ids)
        running = [r for r in running if len(pending[r]) < turns[r]]
    obs = [observation_ids(tok, [{"role": "tool", "content": f"obs {k}"}], stops) for k in (1, 2)]
    for r in range(6):
        length = int(b[K.ATTENTION_MASK][r, -48:].sum())
        segments = runs(b[K.RESPONSES][r, :length].tolist(), b[K.RESPONSE_MASK][r, :length].tolist())
        assert [ids for m, ids in segments if m == 1] == pending[r][: turns[r]]
        assert [ids for m, ids in segments if m == 0] == obs[: len([s for s in segments if s[0] == 0])]
    assert mismatched_rows(b[K.SAMPLED_IDS_HASH], b[K.RESPONSES], b[K.RESPONSE_MASK]) == []  # token parity holds
    env = b[K.ENV_REWARDS]
    done = out.non_tensor_batch[K.STOP_REASON] == "done"
    assert torch.allclose(env.sum(-1)[torch.tensor(done)], torch.tensor(1.5))
    assert (env[b[K.RESPONSE_MASK] == 0] == 0).all()  # rewards sit on model tokens


def test_trainer_log_probs_equal_the_rollout_log_probs_on_model_tokens(generated):
    group, _, _, out, _ = generated
    old = group.compute_log_prob(out, temperature=1.0).batch[K.OLD_LOG_PROBS]
    mask = out.batch[K.RESPONSE_MASK].bool()
    torch.testing.assert_close(old[mask], out.batch[K.ROLLOUT_LOG_PROBS][mask], atol=1e-4, rtol=0)


def test_observation_tokens_get_no_loss_gradient(generated):
    group, _, _, out, _ = generated
    b = out.batch
    mask = b[K.RESPONSE_MASK]
    obs = (b[K.ATTENTION_MASK][:, -mask.shape[1] :] == 1) & (mask == 0)
    assert obs.any()
    old = group.compute_log_prob(out, temperature=1.0).batch[K.OLD_LOG_PROBS]
    micro = {K.RESPONSE_MASK: mask, K.OLD_LOG_PROBS: old, K.ADVANTAGES: torch.randn(mask.shape) * mask}
    loss_fn = actor_loss_builder(ActorConfig(ppo_mini_batch_size=4))(global_norm(mask))

    def loss_of(batch: dict, log_probs: torch.Tensor) -> torch.Tensor:
        return loss_fn({"log_probs": log_probs}, batch)[0]

    log_probs = (old + 0.1 * torch.randn(old.shape)).requires_grad_(True)
    loss_of(micro, log_probs).backward()
    assert (log_probs.grad[obs] == 0).all() and (log_probs.grad[mask.bool()] != 0).any()
    noisy = {**micro, K.ADVANTAGES: micro[K.ADVANTAGES] + 5.0 * obs, K.OLD_LOG_PROBS: old - 3.0 * obs}
    assert torch.equal(loss_of(noisy, log_probs.detach() + 2.0 * obs), loss_of(micro, log_probs.detach()))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"multi_turn": {"enable": True, "env": "nope"}}, "rollout.multi_turn.env='nope' is not a registered"),
        ({"multi_turn": {"max_assistant_turns": 0}}, "rollout.multi_turn.max_assistant_turns must be >= 1"),
    ],
)
def test_bad_multi_turn_configs_are_refused_at_load(overrides, message):
    kwargs = {"multi_turn": {"enable": True}, **overrides}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        RolloutConfig(**kwargs)


def test_multi_turn_with_an_off_policy_trainer_mode_loads():
    """The loop runs on the rollout's own workers (tests/test_agent_cli.py trains that way)."""
    from hybridflow.config.run import RunConfig
    from hybridflow.utils.config_loader import load_config

    overrides = ["rollout.multi_turn.enable=true", "trainer.mode=one_step_off", "trainer.placement=split"]
    run = load_config(RunConfig, None, overrides)
    assert run.trainer.mode == "one_step_off" and run.rollout.multi_turn.enable


def test_the_worker_reports_the_loop_times_beside_its_own(generated):
    metrics = generated[3].meta_info[K.META_METRICS]
    assert metrics["agent/rounds"] >= 2 and metrics["timing_s/generate_on_worker"] >= metrics["agent/loop_time_s"]
    assert metrics["agent/loop_time_s"] >= metrics["agent/generate_time_s"] + metrics["agent/env_time_s"]
    assert 0.0 <= metrics["agent/env_time_share"] <= 1.0
