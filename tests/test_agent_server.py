"""The OpenAI-compatible server (hybridflow/endpoint/app.py) driven by the real `openai` client over
loopback HTTP: a tiny random Llama where sampled tokens matter, a scripted backend where the point is
the HTTP / session logic."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from hybridflow.agent.loop.batch import trajectories_to_batch
from hybridflow.agent.loop.tokens import encode
from hybridflow.endpoint.app import AgentServer, RunningServer, ServerConfig, start_server
from hybridflow.endpoint.backend import GenerationRequest, Sample
from hybridflow.endpoint.rollout_backend import load_rollout_backend
from hybridflow.models import load_tokenizer, tiny_model_dir

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model_dir("llama"))


class Recording:
    """Wraps a backend; keeps every call's requests and samples."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.max_tokens, self.stop_ids, self.max_model_len = backend.max_tokens, backend.stop_ids, backend.max_model_len
        self.calls: list[tuple[list[GenerationRequest], list[list[Sample]]]] = []

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        out = self.backend.generate(requests)
        self.calls.append((requests, out))
        return out


class Scripted:
    """A backend whose k-th sample of a request is `reply(request, k)` as text, ended by EOS."""

    def __init__(self, tokenizer, reply: Callable[[GenerationRequest, int], str]) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.max_tokens, self.stop_ids, self.max_model_len = 64, (tokenizer.eos_token_id,), 400

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        out = []
        for req in requests:
            ids = [encode(self.tokenizer, self.reply(req, k)) + [self.stop_ids[0]] for k in range(req.n)]
            out.append([Sample(s, [-0.25] * len(s), "stop", True) for s in ids])
        return out


@pytest.fixture(scope="module")
def tiny_backend():
    return load_rollout_backend(tiny_model_dir("llama"), max_tokens=16)


@contextmanager
def serving(backend, tokenizer, **config) -> Iterator[tuple[RunningServer, openai.OpenAI]]:
    running = start_server(AgentServer(backend, tokenizer, ServerConfig(**config)), "127.0.0.1", 0)
    client = openai.OpenAI(base_url=running.url, api_key=config.get("api_key") or "sk-local", max_retries=0, timeout=60)
    try:
        yield running, client
    finally:
        running.stop()


def _chat(client, messages, session="s", **kw):
    return client.chat.completions.create(model="m", messages=messages, extra_headers={"x-session-id": session}, **kw)


def test_chat_completions_and_models_on_a_tiny_model(tiny_backend, tokenizer):
    backend = Recording(tiny_backend)
    with serving(backend, tokenizer, model_name="tiny") as (_, client):
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = _chat(client, [{"role": "user", "content": "hi"}], n=2, max_tokens=6, logprobs=True, temperature=0.9)
        done = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=5, logprobs=1)
    assert len(chat.choices) == 2 and len(backend.calls) == 2
    sampled = backend.calls[0][1][0]
    for choice, sample in zip(chat.choices, sampled):
        assert choice.token_ids == sample.token_ids and 1 <= len(sample.token_ids) <= 6
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(sample.log_probs)
    (text,) = done.choices
    assert text.text == tokenizer.decode(text.token_ids) and len(text.logprobs.token_logprobs) == len(text.token_ids)
    assert done.usage.prompt_tokens == len(tokenizer("The capital of France is")["input_ids"])


def test_multi_turn_session_records_the_sampled_ids_token_by_token(tiny_backend, tokenizer):
    backend = Recording(tiny_backend)
    with serving(backend, tokenizer) as (running, client):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count to three"}]
        for turn in range(3):
            reply = _chat(client, messages, session="traj-1", max_tokens=8 + turn).choices[0].message
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": f"more {turn}"}]
        (traj,) = running.server.pop_session("traj-1", "sk-local", row_index=3)
    prompts = [reqs[0].prompt_ids for reqs, _ in backend.calls]
    samples = [outs[0][0] for _, outs in backend.calls]
    for prompt, sample, following in zip(
        prompts, samples, prompts[1:]
    ):  # the model's tokens are kept, never re-encoded
        assert following[: len(prompt) + len(sample.token_ids)] == prompt + sample.token_ids
    assert traj.prompt_ids + traj.response_ids == prompts[-1] + samples[-1].token_ids
    model_ids = [t for t, m in zip(traj.response_ids, traj.response_mask) if m]
    model_logps = [p for p, m in zip(traj.rollout_log_probs, traj.response_mask) if m]
    assert model_ids == [t for s in samples for t in s.token_ids]
    assert model_logps == pytest.approx([p for s in samples for p in s.log_probs])
    assert traj.row_index == 3 and traj.assistant_turns == 3 and traj.user_turns == 2
    batch = trajectories_to_batch([traj], pad_id=0)
    assert int(batch.batch["response_mask"].sum()) == len(model_ids)


def test_n_choices_fork_and_the_continued_one_is_extended(tokenizer):
    backend = Recording(Scripted(tokenizer, lambda req, k: f"answer {k} after {len(req.prompt_ids)}"))
    with serving(backend, tokenizer) as (running, client):
        first = _chat(client, [{"role": "user", "content": "q"}], n=3)
        picked = first.choices[1].message.content
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": picked}]
        _chat(client, messages + [{"role": "user", "content": "and?"}])
        metrics = running.server.metrics()
        trajs = running.server.pop_session("s", "sk-local")
    assert metrics["sessions/extended"] == 1 and metrics["sessions/split"] == 0
    first_prompt, chosen = backend.calls[0][0][0].prompt_ids, backend.calls[0][1][0][1].token_ids
    assert backend.calls[1][0][0].prompt_ids[: len(first_prompt) + len(chosen)] == first_prompt + chosen
    assert sorted(t.assistant_turns for t in trajs) == [1, 1, 2]


def test_tool_calls_round_trip_in_the_chat_format(tokenizer):
    # compact JSON: not what format_tool_call would write, so re-rendering the turn would change its ids
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'

    def reply(req: GenerationRequest, k: int) -> str:
        return "It is 5." if "<|im_start|>tool" in tokenizer.decode(req.prompt_ids) else call

    backend = Recording(Scripted(tokenizer, reply))
    with serving(backend, tokenizer) as (running, client):
        messages = [{"role": "user", "content": "what is 2+3?"}]
        first = _chat(client, messages, tools=[CALC])
        (tool_call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and tool_call.function.name == "calculator"
        assert json.loads(tool_call.function.arguments) == {"expression": "2+3"}
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": tool_call.id, "content": "5"}]
        second = _chat(client, messages, tools=[CALC])
        metrics = running.server.metrics()
    assert second.choices[0].message.content == "It is 5." and second.choices[0].finish_reason == "stop"
    assert metrics["sessions/extended"] == 1 and metrics["sessions/split"] == 0
    (p1, s1), p2 = (backend.calls[0][0][0].prompt_ids, backend.calls[0][1][0][0].token_ids), backend.calls[1][0][0]
    assert "calculator" in tokenizer.decode(p1)  # the schema is in the prompt (SmolLM2: a system message)
    assert p2.prompt_ids[: len(p1) + len(s1)] == p1 + s1
    assert "5" in tokenizer.decode(p2.prompt_ids[len(p1) + len(s1) :])


def test_concurrent_requests_run_as_one_batched_generate_call(tokenizer):
    backend = Recording(Scripted(tokenizer, lambda req, k: "ok"))
    replies: dict[str, str] = {}
    with serving(backend, tokenizer, max_wait_s=5.0, max_batch=2) as (_, client):

        def ask(session: str) -> None:
            replies[session] = (
                _chat(client, [{"role": "user", "content": session}], session=session).choices[0].message.content
            )

        threads = [threading.Thread(target=ask, args=(f"c{i}",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert replies == {"c0": "ok", "c1": "ok"}
    assert [len(reqs) for reqs, _ in backend.calls] == [2]


@pytest.mark.parametrize("policy", ["split", "refuse"])
def test_edited_history_is_split_or_refused(tokenizer, policy):
    backend = Scripted(tokenizer, lambda req, k: "first answer")
    with serving(backend, tokenizer, on_mismatch=policy) as (running, client):
        reply = _chat(client, [{"role": "user", "content": "q"}]).choices[0].message.content
        edited = [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply + " (edited)"}]
        edited.append({"role": "user", "content": "go on"})
        if policy == "refuse":
            with pytest.raises(openai.BadRequestError, match="history was edited"):
                _chat(client, edited)
        else:
            _chat(client, edited)
        metrics = running.server.metrics()
        trajs = running.server.pop_session("s", "sk-local")
    assert metrics[f"sessions/{'split' if policy == 'split' else 'refused'}"] == 1
    assert metrics["sessions/extended"] == 0
    assert len(trajs) == (2 if policy == "split" else 1)


def test_stop_string_cuts_the_turn_and_the_template_closes_it(tokenizer):
    backend = Recording(Scripted(tokenizer, lambda req, k: "hello STOP world"))
    with serving(backend, tokenizer) as (running, client):
        first = _chat(client, [{"role": "user", "content": "q"}], stop=["STOP"])
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": first.choices[0].message.content},
        ]
        _chat(client, messages + [{"role": "user", "content": "again"}])
        (traj,) = running.server.pop_session("s", "sk-local")
    assert first.choices[0].message.content == "hello " and first.choices[0].finish_reason == "stop"
    kept = first.choices[0].token_ids
    assert "STOP" in tokenizer.decode(kept) and "world" not in tokenizer.decode(kept)
    closing = len(kept)  # the cut turn is closed by the end-of-turn id as an observation token (mask 0)
    assert traj.response_ids[closing] == tokenizer.eos_token_id and traj.response_mask[closing] == 0
    assert traj.response_mask[:closing] == [1] * closing


def test_stream_and_bad_fields_get_clear_400s(tokenizer):
    with serving(Scripted(tokenizer, lambda req, k: "x"), tokenizer) as (_, client):
        with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
            _chat(client, [{"role": "user", "content": "q"}], stream=True)
        with pytest.raises(openai.BadRequestError, match="top_p must be in"):
            _chat(client, [{"role": "user", "content": "q"}], top_p=0)
        with pytest.raises(openai.BadRequestError, match="the model takes at most 400"):
            _chat(client, [{"role": "user", "content": "word " * 500}])


def test_the_least_recently_used_sessions_are_evicted_past_max_sessions(tokenizer):
    with serving(Scripted(tokenizer, lambda req, k: "x"), tokenizer, max_sessions=2) as (running, client):
        for session in ("a", "b", "a", "c"):
            _chat(client, [{"role": "user", "content": "q"}], session=session)
        assert running.server.metrics()["sessions/evicted"] == 1
        assert sorted(sid for _, sid in running.server.sessions.pop_all()) == ["a", "c"]


def test_api_key_is_required_when_set(tokenizer):
    with serving(Scripted(tokenizer, lambda req, k: "x"), tokenizer, api_key="sekrit") as (running, client):
        assert _chat(client, [{"role": "user", "content": "q"}]).choices[0].message.content == "x"
        intruder = openai.OpenAI(base_url=running.url, api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            _chat(intruder, [{"role": "user", "content": "q"}])


def test_non_loopback_bind_without_a_key_is_refused(tokenizer, capsys):
    from hybridflow.cli.main import main

    server = AgentServer(Scripted(tokenizer, lambda req, k: "x"), tokenizer)
    try:
        with pytest.raises(ValueError, match="without an API key"):
            start_server(server, "0.0.0.0", 0)
    finally:
        server.close()
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--api-key" in err[0]


def test_session_carriers_header_extra_body_and_api_key(tokenizer):
    backend = Scripted(tokenizer, lambda req, k: "x")
    with serving(backend, tokenizer) as (running, client):
        question = [{"role": "user", "content": "q"}]
        _chat(client, question, session="from-header")
        client.chat.completions.create(model="m", messages=question, extra_body={"session_id": "from-body"})
        keyed = openai.OpenAI(base_url=running.url, api_key="from-key", max_retries=0, timeout=30)
        keyed.chat.completions.create(model="m", messages=question)
        sessions = running.server.sessions.pop_all()
    assert sorted(sid for _, sid in sessions) == ["from-body", "from-header", "from-key"]
    assert all(len(trajs) == 1 for trajs in sessions.values())


def test_a_failing_backend_call_is_a_500_and_the_server_serves_on(tokenizer):
    fail = [True]

    def reply(req: GenerationRequest, k: int) -> str:
        if fail.pop() if fail else False:
            raise RuntimeError("backend exploded")
        return "fine"

    with serving(Scripted(tokenizer, reply), tokenizer) as (running, client):
        with pytest.raises(openai.InternalServerError, match=r"the server failed on this request \(error id"):
            _chat(client, [{"role": "user", "content": "q"}])
        assert _chat(client, [{"role": "user", "content": "q"}]).choices[0].message.content == "fine"
        assert running.server.metrics()["server/backend_calls"] == 2


@pytest.mark.slow  # a model-loading subprocess (16 s alone); the in-process server tests above cover the endpoint
def test_serve_cli_prints_its_url_answers_and_stops_on_ctrl_c():
    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "hybridflow.cli.main", "serve", "--model", str(tiny_model_dir("llama"))]
    proc = subprocess.Popen(command + ["--port", "0", "--max-tokens", "4"], cwd=repo, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=180)
        assert line.startswith("serving ") and " at http://127.0.0.1:" in line, line
        client = openai.OpenAI(base_url=line.split(" at ")[-1].strip(), api_key="k", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert 1 <= len(reply.choices[0].token_ids) <= 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_rollout_backend_stops_at_extra_stop_ids_and_max_tokens(tiny_backend):
    prompt = [1, 504, 3458, 28]
    (greedy,) = tiny_backend.generate([GenerationRequest(prompt, 6, temperature=0)])[0]
    assert len(greedy.token_ids) == 6 and greedy.finish_reason == "length"
    stop = greedy.token_ids[2]
    (cut,) = tiny_backend.generate([GenerationRequest(prompt, 6, temperature=0, stop_ids=(stop,))])[0]
    end = greedy.token_ids.index(stop) + 1
    assert cut.token_ids == greedy.token_ids[:end] and cut.finish_reason == "stop" and not cut.stopped_on_id
    assert cut.log_probs == pytest.approx(greedy.log_probs[:end])


def test_two_requests_extending_one_branch_at_once_keep_both_trajectories(tokenizer):
    from hybridflow.endpoint.sessions import SessionStore

    store, eos = SessionStore(tokenizer, [tokenizer.eos_token_id]), tokenizer.eos_token_id
    reply = {"role": "assistant", "content": "a"}
    first = store.begin_chat("s", [{"role": "user", "content": "q"}], [])
    store.commit(first, [Sample([64, eos], [-1.0, -2.0], "stop", True)], [reply])
    history = [{"role": "user", "content": "q"}, reply]
    left = store.begin_chat("s", [*history, {"role": "user", "content": "left"}], [])
    right = store.begin_chat("s", [*history, {"role": "user", "content": "right"}], [])
    store.commit(left, [Sample([65, eos], [-0.5, -0.5], "stop", True)], [reply])
    store.commit(right, [Sample([66, eos], [-0.5, -0.5], "stop", True)], [reply])
    trajs = store.pop("s")
    assert sorted(t.prompt_ids + t.response_ids for t in trajs) == sorted(
        [left.prompt_ids + [65, eos], right.prompt_ids + [66, eos]]
    )
    assert all(t.response_mask[:2] == [1, 1] and t.assistant_turns == 2 for t in trajs)
    store.commit(store.begin_chat("gone", history[:1], []), [Sample([64, eos], [-1.0, -2.0], "stop", True)], [reply])
    late = store.begin_chat("gone", [*history, {"role": "user", "content": "late"}], [])
    store.pop("gone")  # a trainer popping the session before the request's samples arrive does not lose them
    store.commit(late, [Sample([67, eos], [-1.0, -1.0], "stop", True)], [reply])
    (kept,) = store.pop("gone")
    assert kept.prompt_ids + kept.response_ids == late.prompt_ids + [67, eos]
