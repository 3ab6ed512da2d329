"""A server that one request cannot break (issue 56): the request checks, the batcher's per-request failures, and
the server's admission, timeout, disconnect, stop and session scoping, over loopback HTTP with real clients
(`openai`, httpx2) and scripted backends that block or fail on cue. The load test with the tiny model in its own
process is tests/test_serve_load.py."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx2
import openai
import pytest

from hybridflow.agent.loop.tokens import encode
from hybridflow.endpoint.app import AgentServer, ServerConfig, start_server
from hybridflow.endpoint.backend import Batcher, GenerationRequest, Sample
from hybridflow.endpoint.limits import ServerLimits, parse_limits
from hybridflow.endpoint.openai_format import RequestError, parse_messages, parse_params, parse_prompt
from hybridflow.models import load_tokenizer, tiny_model_dir

LIMITS = ServerLimits()
USER = [{"role": "user", "content": "q"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model_dir("llama"))


class Gated:
    """A backend that answers "ok" (or raises for a prompt holding "boom") once `gate` is set; records its calls."""

    def __init__(self, tokenizer, open_gate: bool = True) -> None:
        self.tokenizer = tokenizer
        self.max_tokens, self.stop_ids, self.max_model_len = 16, (tokenizer.eos_token_id,), 400
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()
        self.entered = threading.Event()
        self.calls: list[list[str]] = []

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        texts = [self.tokenizer.decode(r.prompt_ids) for r in requests]
        self.calls.append(texts)
        self.entered.set()
        self.gate.wait(timeout=60)
        if any("boom" in t for t in texts):
            raise RuntimeError("secret internal detail /opt/model/weights.bin")
        ids = encode(self.tokenizer, "ok") + [self.stop_ids[0]]
        return [[Sample(list(ids), [-0.5] * len(ids), "stop", True) for _ in range(r.n)] for r in requests]


def _serve(backend, tokenizer, **config):
    return start_server(AgentServer(backend, tokenizer, ServerConfig(**config)), "127.0.0.1", 0)


def _client(running, key="sk-a", timeout=30.0):
    return openai.OpenAI(base_url=running.url, api_key=key, max_retries=0, timeout=timeout)


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _send_and_leave(running, messages, until) -> None:
    """POST a chat request over a raw HTTP connection, wait for `until()`, then close the connection unanswered."""
    url = urlsplit(running.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = json.dumps({"model": "m", "messages": messages})
    conn.request("POST", url.path + "/chat/completions", body, {"content-type": "application/json"})
    _wait(until)
    conn.close()


def _refused(body, match, fn=parse_params):
    with pytest.raises(RequestError, match=match) as err:
        fn(body, 16, LIMITS) if fn is parse_params else fn(body, LIMITS)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"max_tokens": float("inf")}, "max_tokens must be a finite number"),
        ({"temperature": 10**400}, "temperature is out of range"),
        ({"n": 10**7}, r"n must be between 1 and 16 \(this server's max_n\)"),
        ({"n": 1e308}, "n must be between 1 and 16"),
        ({"n": 0}, "n must be between 1 and 16"),
        ({"n": "3"}, "n must be an integer, got a str"),
        ({"n": True}, "n must be an integer, got a bool"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop has 17 strings; this server takes at most 16"),
        ({"stop": ["x" * 257]}, "longer than this server's 256 characters"),
        ({"stop": {"a": 1}}, "stop must be a string or a list of strings"),
    ],
)
def test_sampling_fields_must_be_finite_and_within_the_limits(body, match):
    _refused(body, match)


def test_good_sampling_fields_pass_and_max_tokens_is_clamped():
    params = parse_params({"n": 16, "temperature": 0, "top_p": 1, "max_tokens": 1e308, "stop": "x"}, 16, LIMITS)
    assert (params.n, params.temperature, params.max_tokens, params.stop) == (16, 0.0, 16, ("x",))
    assert parse_params({"n": 4}, 16, ServerLimits(max_n=4)).n == 4


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": {"a": 1}}], r"messages\[0\].content must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "a list of text parts"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "a list of text parts"),
        ([{"role": "assistant", "content": "a", "tool_calls": "call"}], r"messages\[0\].tool_calls must be a list"),
        ([{"role": "user", "content": "q"}] * 1025, "1025 messages; this server takes at most 1024"),
        ("hi", "messages must be a non-empty list"),
        ([{"content": "hi"}], r"messages\[0\] needs a role"),
    ],
)
def test_messages_must_be_text_and_bounded(messages, match):
    _refused({"messages": messages}, match, parse_messages)


def test_content_parts_and_null_content_are_text():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ]
    assert parse_messages({"messages": messages}, LIMITS)[0] == messages


def test_prompts_and_token_ids_are_checked():
    assert parse_prompt([1, 2, 99], LIMITS, 100) == [[1, 2, 99]]
    assert parse_prompt(["a", "b"], LIMITS, 100) == ["a", "b"]
    for prompt, match in [
        ([1, 100], r"token ids must be in \[0, 100\)"),
        ([-1, 2], r"token ids must be in \[0, 100\)"),
        ([1, True], "prompt must be a string, a list of strings or a list of token ids"),
        (["a"] * 65, "65 prompts; this server takes at most 64"),
        ([], "prompt must be"),
        ({"a": 1}, "prompt must be"),
    ]:
        with pytest.raises(RequestError, match=match):
            parse_prompt(prompt, LIMITS, 100)


def test_limits_parse_from_key_values_and_refuse_bad_ones():
    limits = parse_limits(["max_n=4", "request_timeout_s=2.5"])
    assert (limits.max_n, limits.request_timeout_s, limits.max_stop) == (4, 2.5, ServerLimits.max_stop)
    with pytest.raises(ValueError, match="serve limit max_nn: .*keys: max_body_bytes, max_n"):
        parse_limits(["max_nn=4"])
    with pytest.raises(ValueError, match="serve limit max_n: "):
        parse_limits(["max_n=four"])
    with pytest.raises(ValueError, match="serve limit max_queued must be > 0, got 0"):
        parse_limits(["max_queued=0"])
    with pytest.raises(ValueError, match="serve limits are key=value, got 'max_n'"):
        parse_limits(["max_n"])
    with pytest.raises(ValueError, match="request_timeout_s must be > 0, got nan"):
        ServerLimits(request_timeout_s=float("nan"))


def test_a_failing_request_fails_alone_and_its_batch_neighbours_are_served(tokenizer):
    backend = Gated(tokenizer, open_gate=False)
    batcher = Batcher(backend, max_wait_s=0.2)
    try:
        prompts = [encode(tokenizer, t) for t in ("one", "two boom", "three", "four")]
        futures = [batcher.submit(GenerationRequest(p, 4)) for p in prompts]
        backend.gate.set()
        with pytest.raises(RuntimeError, match="secret internal detail"):
            futures[1].result(timeout=30)
        assert [len(futures[i].result(timeout=30)) for i in (0, 2, 3)] == [1, 1, 1]
    finally:
        batcher.close()
    assert batcher.batch_sizes == [4] and sorted(map(len, backend.calls)) == [1, 1, 2, 2, 4]  # halves, then one each


def test_a_request_cancelled_while_queued_is_never_generated(tokenizer):
    backend = Gated(tokenizer, open_gate=False)
    batcher = Batcher(backend, max_wait_s=0.001)
    try:
        first = batcher.submit(GenerationRequest(encode(tokenizer, "first"), 4))
        assert backend.entered.wait(30)
        left = batcher.submit(GenerationRequest(encode(tokenizer, "left"), 4))
        kept = batcher.submit(GenerationRequest(encode(tokenizer, "kept"), 4))
        assert left.cancel()
        backend.gate.set()
        first.result(timeout=30), kept.result(timeout=30)
    finally:
        batcher.close()
    assert [t for call in backend.calls for t in call] == ["first", "kept"] and batcher.dropped == 1


def test_a_bad_request_gets_its_400_and_its_concurrent_neighbours_their_200s(tokenizer):
    running = _serve(Gated(tokenizer), tokenizer, max_wait_s=0.05)
    client = _client(running)
    bad = [{"role": "user", "content": {"not": "text"}}]
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(client.chat.completions.create, model="m", messages=m) for m in (USER, bad, USER, USER)
            ]
            with pytest.raises(openai.BadRequestError, match="content must be a string"):
                futures[1].result()
            assert [futures[i].result().choices[0].message.content for i in (0, 2, 3)] == ["ok"] * 3
    finally:
        running.stop()


def test_a_backend_failure_is_a_500_for_its_request_only_and_says_no_internals(tokenizer, caplog):
    running = _serve(Gated(tokenizer), tokenizer, max_wait_s=0.05)
    client = _client(running)
    try:
        with ThreadPoolExecutor(3) as pool:
            messages = (USER, [{"role": "user", "content": "boom"}], USER)
            futures = [pool.submit(client.chat.completions.create, model="m", messages=m) for m in messages]
            with pytest.raises(openai.InternalServerError) as err:
                futures[1].result()
            assert [futures[i].result().choices[0].message.content for i in (0, 2)] == ["ok", "ok"]
    finally:
        running.stop()
    message = err.value.body["message"]
    assert message.startswith("the server failed on this request (error id ") and "secret" not in message
    error_id = message.split("error id ")[1].split(":")[0]
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)  # the log has the traceback


def test_a_full_server_answers_503_with_retry_after_and_serves_again_once_drained(tokenizer):
    backend = Gated(tokenizer, open_gate=False)
    running = _serve(backend, tokenizer, limits=ServerLimits(max_queued=2, retry_after_s=7))
    client = _client(running)
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(client.chat.completions.create, model="m", messages=USER) for _ in range(2)]
            assert backend.entered.wait(30)
            deadline = time.monotonic() + 30
            while running.server._admitted < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            full = httpx2.post(running.url + "/chat/completions", json={"messages": USER}, timeout=30)
            backend.gate.set()
            assert [f.result().choices[0].message.content for f in held] == ["ok", "ok"]
        assert full.status_code == 503 and full.headers["retry-after"] == "7"
        assert "max_queued" in full.json()["error"]["message"]
        assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content == "ok"
    finally:
        backend.gate.set()
        running.stop()


def test_a_request_past_its_timeout_gets_504_and_its_queued_generation_is_dropped(tokenizer):
    backend = Gated(tokenizer, open_gate=False)
    running = _serve(backend, tokenizer, limits=ServerLimits(request_timeout_s=2.0))
    client = _client(running)
    late = [{"role": "user", "content": "late"}]
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.chat.completions.create, model="m", messages=USER)
            assert backend.entered.wait(30)
            queued = pool.submit(client.chat.completions.create, model="m", messages=late)
            _wait(lambda: running.server.batcher.queued == 1)  # queued behind the generation that holds the gate
            with pytest.raises(openai.APIStatusError, match="request_timeout_s=2") as err:
                queued.result()
            backend.gate.set()
            with pytest.raises(openai.APIStatusError):
                first.result()  # the one generating timed out too (its batch had not finished)
    finally:
        backend.gate.set()
        running.stop()
    assert err.value.status_code == 504
    assert all("late" not in t for call in backend.calls for t in call) and running.server.batcher.dropped == 1


def test_a_client_that_disconnects_costs_no_generation(tokenizer):
    backend = Gated(tokenizer, open_gate=False)
    running = _serve(backend, tokenizer)
    client = _client(running)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.chat.completions.create, model="m", messages=USER)
            assert backend.entered.wait(30)
            gone = [{"role": "user", "content": "gone"}]
            _send_and_leave(running, gone, lambda: running.server.batcher.queued == 1)
            _wait(lambda: running.server.statuses.get(499, 0) == 1)
            backend.gate.set()
            assert first.result().choices[0].message.content == "ok"
    finally:
        backend.gate.set()
        running.stop()
    assert running.server.batcher.dropped == 1
    assert all("gone" not in t for call in backend.calls for t in call)


def test_stop_answers_requests_in_flight_503_without_waiting_for_the_generation(tokenizer):
    backend = Gated(tokenizer, open_gate=False)
    running = _serve(backend, tokenizer)
    client = _client(running)
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(client.chat.completions.create, model="m", messages=USER) for _ in range(3)]
            assert backend.entered.wait(30)
            running.stop()  # the backend is still blocked: the generation never finishes
            for future in futures:
                with pytest.raises(openai.APIStatusError, match="the server is stopping") as err:
                    future.result(timeout=30)
                assert err.value.status_code == 503
    finally:
        backend.gate.set()


def test_a_session_id_sent_with_another_key_names_another_session(tokenizer):
    running = _serve(Gated(tokenizer), tokenizer)
    alice, mallory = _client(running, "sk-alice"), _client(running, "sk-mallory")
    try:
        first = alice.chat.completions.create(model="m", messages=USER, extra_headers={"x-session-id": "s"})
        history = [
            *USER,
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "and?"},
        ]
        mallory.chat.completions.create(model="m", messages=history, extra_headers={"x-session-id": "s"})
        assert running.server.metrics()["sessions/extended"] == 0  # mallory's request did not extend alice's turn
        assert (
            len(running.server.pop_session("s", "sk-alice")) == 1
            and len(running.server.pop_session("s", "sk-mallory")) == 1
        )
        assert running.server.pop_session("s", "sk-alice") == []
    finally:
        running.stop()


class ThreadRecordingTokenizer:
    """The tokenizer, recording the name of every thread that tokenizes or decodes."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.threads = tokenizer, set()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __call__(self, *args, **kwargs):
        self.threads.add(threading.current_thread().name)
        return self._tokenizer(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.threads.add(threading.current_thread().name)
        return self._tokenizer.decode(*args, **kwargs)


def test_tokenization_runs_off_the_event_loop(tokenizer):
    recording = ThreadRecordingTokenizer(tokenizer)
    running = _serve(Gated(tokenizer), recording)
    client = _client(running)
    try:
        recording.threads.clear()
        client.chat.completions.create(model="m", messages=USER, logprobs=True, stop=["k"])
        client.completions.create(model="m", prompt=["a", "b"], max_tokens=2)
    finally:
        running.stop()
    assert recording.threads and "hybridflow-uvicorn" not in recording.threads  # uvicorn's loop runs on that thread


def test_the_endpoint_guide_lists_every_limit_with_its_default():
    import dataclasses
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "endpoint.md").read_text()
    for f in dataclasses.fields(ServerLimits):
        assert f"| `{f.name}` | {f.default} |" in guide, f.name


class Interruptible:
    """A backend that generates until its `interrupted` event is set (as `RolloutBackend` stops early)."""

    def __init__(self) -> None:
        self.max_tokens, self.stop_ids, self.max_model_len = 16, (0,), 400
        self.interrupted, self.entered, self.seen = threading.Event(), threading.Event(), []

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        self.entered.set()
        self.seen.append(self.interrupted.wait(timeout=2))
        return [[Sample([1], [-1.0])] * r.n for r in requests]


def test_a_batch_is_interrupted_once_every_request_of_it_is_abandoned_and_only_then():
    backend = Interruptible()
    batcher = Batcher(backend, max_wait_s=0.2)
    try:
        kept, left = (batcher.submit(GenerationRequest([1], 4)) for _ in range(2))
        assert backend.entered.wait(30)
        batcher.abandon(left)  # its neighbour still waits: the batch runs on (to the backend's 2 s wait)
        assert kept.result(timeout=30) and backend.seen == [False]
        backend.entered.clear()
        alone = batcher.submit(GenerationRequest([1], 4))
        assert backend.entered.wait(30)
        batcher.abandon(alone)
        alone.result(timeout=30)
    finally:
        batcher.close()
    assert backend.seen == [False, True] and not backend.interrupted.is_set()  # cleared after its batch


@pytest.mark.parametrize("name", ["native", "hf"])
def test_an_interrupted_rollout_ends_every_row_after_the_current_step(name):
    import dataclasses

    from hybridflow.endpoint.rollout_backend import load_rollout_backend

    backend = load_rollout_backend(tiny_model_dir("llama"), max_tokens=24, name=name)
    backend.rollout.config = dataclasses.replace(backend.rollout.config, ignore_eos=True)
    requests = [GenerationRequest([1, 504, 3458], 24, n=2), GenerationRequest([1, 28], 24)]
    backend.interrupted.set()
    cut = backend.generate(requests)
    backend.interrupted.clear()
    whole = backend.generate(requests)
    assert [len(s.token_ids) for samples in cut for s in samples] == [1, 1, 1]
    assert [len(s.token_ids) for samples in whole for s in samples] == [24, 24, 24]


def test_a_generation_whose_only_client_disconnects_is_interrupted(tokenizer):
    backend = Interruptible()
    backend.stop_ids = (tokenizer.eos_token_id,)
    running = _serve(backend, tokenizer)
    try:
        _send_and_leave(running, USER, backend.entered.is_set)
        _wait(lambda: backend.seen)
    finally:
        running.stop()
    assert backend.seen == [True]  # the backend was told to stop (else it waits out its 2 s: False)


def test_serve_refuses_a_bad_limit_in_one_line_before_loading_the_model(capsys):
    from hybridflow.cli.main import main

    assert main(["serve", "--model", "/nonexistent", "max_n=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "serve limit max_n must be > 0, got 0" in err[0]
