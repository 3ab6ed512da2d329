"""Training an agent harness (rollout.agent): a plain openai-client function run against the rollout worker's
own endpoint. Trained ids are the sampled ids, a harness that raises or hangs costs its trajectory only, the
config checks, and the calculator example trained end to end on Ray workers."""

from __future__ import annotations

import gc
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from hybridflow.agent.config import AgentConfig
from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.endpoint.harness import run_calls
from hybridflow.engine import EngineConfig
from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.protocol import keys as K
from hybridflow.protocol.token_hash import mismatched_rows
from hybridflow.rollout import RolloutConfig
from hybridflow.train.metrics import agent_metrics
from hybridflow.workers import ActorConfig, ActorRolloutRefWorker, ModelConfig, RefConfig
from tests.test_agent_rollout import prompts, runs, stopping_model
from tests.test_agent_server import Scripted, serving
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli

SAMPLED: list[tuple[int, list[list[int]]]] = []
"""(prompt row, the token ids of each reply) of every `two_turns` call."""
RELEASE = threading.Event()
"""Set at the end of the module: lets the hanging harness's abandoned thread finish."""


EDIT_HISTORY = threading.Event()
"""Set: `two_turns` edits the first message before its second request."""


def two_turns(client, row) -> float:
    """Ask, answer the reply with a tool message, ask again; records the ids the endpoint sampled."""
    messages = [dict(m) for m in row["prompt"]]
    replies = []
    for turn in range(2):
        choice = client.chat.completions.create(model="m", messages=messages, max_tokens=8).choices[0]
        replies.append(choice.model_extra["token_ids"])
        messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "content": f"obs {turn}"}]
        if EDIT_HISTORY.is_set():
            messages[0] = {"role": "user", "content": "EDITED"}
    SAMPLED.append((row["extra_info"]["i"], replies))
    return 0.5 + row["extra_info"]["i"]


def flaky(client, row) -> float | None:
    """Row 0 raises, row 1 hangs (past the timeout), row 2 answers once and leaves the score to the scorer."""
    i = row["extra_info"]["i"]
    if i == 0:
        raise RuntimeError("harness bug")
    if i == 1:
        RELEASE.wait(60)
    client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=4)
    return None


def harness_worker(model: str, function: str, timeout_s: float = 60.0) -> LocalWorkerGroup:
    agent = AgentConfig(function=function, timeout_s=timeout_s, max_concurrency=4)
    rollout = RolloutConfig(n=2, prompt_length=64, response_length=48, dtype="fp32", agent=agent)
    actor = ActorConfig(
        ppo_mini_batch_size=4, ppo_micro_batch_size_per_device=4, engine=EngineConfig(param_dtype="fp32")
    )
    init = ClassWithInitArgs(
        ActorRolloutRefWorker, ModelConfig(path=model), actor, rollout, RefConfig(), "actor_rollout"
    )
    group = LocalWorkerGroup(None, init)
    group.init_model()
    return group


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path, _ = stopping_model(tmp_path_factory.mktemp("harness"))
    yield path
    RELEASE.set()


@pytest.fixture(scope="module")
def two_turn_group(model) -> LocalWorkerGroup:
    return harness_worker(model, f"{__name__}:two_turns")


def test_harness_trajectories_hold_the_sampled_ids_over_two_turns(model, two_turn_group):
    group = two_turn_group
    tok = load_tokenizer(model)
    SAMPLED.clear()
    out = group.generate_sequences(prompts(tok), step=1)
    b = out.batch
    assert len(out) == 6 and list(out.non_tensor_batch[K.UID]) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert list(out.non_tensor_batch[K.HARNESS_STATUS]) == ["ok"] * 6
    assert list(out.non_tensor_batch[K.NUM_TURNS]) == [2] * 6
    trained = {r: [] for r in range(3)}
    for row in range(6):
        length = int(b[K.ATTENTION_MASK][row, -48:].sum())
        segments = runs(b[K.RESPONSES][row, :length].tolist(), b[K.RESPONSE_MASK][row, :length].tolist())
        trained[row // 2].append([ids for m, ids in segments if m == 1])
        assert [m for m, _ in segments] == [1, 0, 1]  # reply, the tool message's template tokens, reply
    for r in range(3):
        sampled = sorted(replies for i, replies in SAMPLED if i == r)
        assert sorted(trained[r]) == sampled
    assert mismatched_rows(b[K.SAMPLED_IDS_HASH], b[K.RESPONSES], b[K.RESPONSE_MASK]) == []  # token parity holds
    rewards = b[K.ENV_REWARDS].sum(-1)
    assert rewards.tolist() == [0.5, 0.5, 1.5, 1.5, 2.5, 2.5]
    last_model_token = torch.stack([m.nonzero().max() for m in b[K.RESPONSE_MASK]])
    assert (b[K.ENV_REWARDS].argmax(-1) == last_model_token).all()
    old = group.compute_log_prob(out, temperature=1.0).batch[K.OLD_LOG_PROBS]
    mask = b[K.RESPONSE_MASK].bool()
    torch.testing.assert_close(old[mask], b[K.ROLLOUT_LOG_PROBS][mask], atol=1e-4, rtol=0)


def test_a_harness_that_edits_its_history_trains_its_last_trajectory(model, two_turn_group):
    tok = load_tokenizer(model)
    EDIT_HISTORY.set()
    try:
        out = two_turn_group.generate_sequences(prompts(tok), step=2)
    finally:
        EDIT_HISTORY.clear()
    assert out.meta_info[K.META_METRICS]["endpoint/split"] == 6
    assert list(out.non_tensor_batch[K.HARNESS_STATUS]) == ["ok"] * 6
    assert list(out.non_tensor_batch[K.NUM_TURNS]) == [1] * 6  # the split-off trajectory: the second request
    for row in out.batch[K.PROMPTS]:
        assert "EDITED" in tok.decode(row[row != tok.pad_token_id])
    b = out.batch
    assert mismatched_rows(b[K.SAMPLED_IDS_HASH], b[K.RESPONSES], b[K.RESPONSE_MASK]) == []  # the trained branch's


def test_a_harness_that_raises_or_hangs_costs_its_trajectory_only(model):
    group = harness_worker(model, f"{__name__}:flaky", timeout_s=3.0)
    tok = load_tokenizer(model)
    batch = prompts(tok)
    batch.non_tensor_batch[K.DATA_SOURCE][:] = "arithmetic"  # row 2's None reward: the arithmetic scorer's
    start = time.monotonic()
    out = group.generate_sequences(batch, step=1)
    assert time.monotonic() - start < 30
    statuses = list(out.non_tensor_batch[K.HARNESS_STATUS])
    assert statuses == ["error", "error", "timeout", "timeout", "ok", "ok"]
    mask = out.batch[K.RESPONSE_MASK]
    assert (mask[:4] == 0).all() and (mask[4:].sum(-1) > 0).all()
    assert (out.batch[K.ENV_REWARDS][:4] == 0).all()
    uids = list(out.non_tensor_batch[K.UID])
    assert uids[4:] == ["u2", "u2"] and len(set(uids[:4])) == 4 and all(u.startswith("u0/") for u in uids[:2])
    metrics = agent_metrics(out)
    assert metrics["agent/harness_errors"] == 2 and metrics["agent/harness_timeouts"] == 2
    assert metrics["agent/harness_dropped"] == 4
    assert out.meta_info[K.META_METRICS]["endpoint/requests"] == 2
    group.compute_log_prob(out, temperature=1.0)  # the dropped rows go through the trainer's passes
    port = group._worker._harness.running.port
    group.shutdown()
    gc.collect()
    with pytest.raises(ConnectionRefusedError):  # the endpoint stopped with its worker
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_run_calls_bounds_concurrency_and_times_calls_out_from_their_start():
    running, peak, lock = [0], [0], threading.Lock()

    def call(seconds: float):
        def run():
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(seconds)
            with lock:
                running[0] -= 1
            return seconds

        return run

    outcomes = run_calls([call(0.2)] * 4 + [call(5.0)], max_concurrency=2, timeout_s=1.0)
    assert [o.status for o in outcomes] == ["ok"] * 4 + ["timeout"]
    assert peak[0] == 2


def test_the_calculator_example_runs_the_tool_calls_the_model_makes():
    from hybridflow.agent.loop.tool_calls import format_tool_call
    from hybridflow.endpoint.examples.calculator import run

    tokenizer = load_tokenizer(tiny_model_dir("llama"))

    def reply(request, k):  # a tool call first; once the result is in the prompt, the answer
        if "408" in tokenizer.decode(request.prompt_ids):
            return "The answer is 408."
        return format_tool_call("calculator", {"expression": "12 * 34"})

    row = {"prompt": [{"role": "user", "content": "What is 12 * 34?"}], "data_source": "tool_arithmetic"}
    with serving(Scripted(tokenizer, reply), tokenizer) as (running, client):
        client = client.with_options(default_headers={"x-session-id": "s"})
        assert run(client, row) is None
        (traj,) = running.server.pop_session("s", "sk-local")
    assert traj.assistant_turns == 2 and traj.tool_calls == 1
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2]["content"] == "408" and traj.messages[-1]["content"] == "The answer is 408."


HARNESS_FILE = "def run(client, row):\n    return 1.0\n\n\ndef wrong(client):\n    return 1.0\n"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.name=vllm"], "rollout.agent.function with rollout.name='vllm' is not supported yet"),
        (["rollout.multi_turn.enable=true"], "rollout.agent.function and rollout.multi_turn.enable=true both"),
        (["rollout.tensor_model_parallel_size=2"], "rollout.agent.function with rollout.tensor_model_parallel_size"),
        (["rollout.agent.function=h.py:wrong"], "must be callable as run(client, row)"),
        (["rollout.agent.function=h.py:nope"], "has no attribute 'nope'"),
        (["rollout.agent.timeout_s=0"], "rollout.agent.timeout_s must be > 0"),
        (["rollout.agent.on_mismatch=edit"], "rollout.agent.on_mismatch must be one of"),
    ],
)
def test_bad_harness_configs_are_refused_at_load(tmp_path, monkeypatch, overrides, message):
    from hybridflow.config.run import RunConfig
    from hybridflow.utils.config_loader import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.py").write_text(HARNESS_FILE)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config(RunConfig, None, ["rollout.agent.function=h.py:run", *overrides])


def calculator_args(tmp_path: Path, workers: int = 1) -> list[str]:
    return [
        *base_overrides(str(tiny_model_dir("llama")), tmp_path),
        "data.task=tool_arithmetic",
        "data.max_prompt_length=256",
        "rollout.agent.function=hybridflow.endpoint.examples.calculator:run",
        f"trainer.n_workers_per_node={workers}",
        "trainer.val_before_train=false",
    ]


def test_the_calculator_harness_trains_on_ray_workers(tmp_path: Path):
    args = calculator_args(tmp_path)
    proc = run_cli(["train", *args], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = read_metrics(tmp_path)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["agent/turns/mean"] >= 1 and r["agent/harness_dropped"] == 0
        assert r["endpoint/requests"] >= 8  # 4 prompts x 2 samples on 1 worker: a request each at least
    assert "val-core/tool_arithmetic/acc/mean@1" in records[-1] and "val-aux/agent/harness_errors" in records[-1]


@pytest.mark.slow  # a Ray run over two pools
def test_the_calculator_harness_trains_one_step_off_on_its_own_rollout_workers(tmp_path: Path):
    """The harness's endpoint runs on the rollout's own workers, generating step 2's batch while step 1 trains; its
    rows carry the version of the weights that sampled each token, and the trained ids are the sampled ids."""
    args = [*calculator_args(tmp_path, workers=2), "trainer.mode=one_step_off", "trainer.placement=split"]
    proc = run_cli(["train", *args, "trainer.save_freq=1"], tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["async/staleness/max"] for r in steps] == [0.0, 1.0]
    assert all(r["agent/harness_dropped"] == 0 and r["parity/token_mismatch_rows"] == 0 for r in steps)
    from hybridflow.train.async_pipeline import _load_queued

    queued = _load_queued(tmp_path / "ckpt" / "global_step_1" / "rollout_queue", 2).batch
    mask = queued[K.RESPONSE_MASK].bool()
    assert mask.any() and set(queued[K.TOKEN_POLICY_VERSION][mask].tolist()) == {0}
    assert mismatched_rows(queued[K.SAMPLED_IDS_HASH], queued[K.RESPONSES], queued[K.RESPONSE_MASK]) == []
