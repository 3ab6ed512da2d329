"""The Tinker service driven by the real `tinker` SDK over HTTP on 127.0.0.1, on a tiny random model.

Training (cross_entropy and the RL losses), sampler snapshots, compute_logprobs, checkpoints and sessions go
through the SDK's public clients; what the public clients cannot send on purpose (an unknown model id, a
malformed protobuf, a reused seq_id) goes through the SDK's own low-level client (`tinker.AsyncTinker`), so the
wire format is still the SDK's.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker._client import AsyncTinker  # noqa: E402
from tinker._exceptions import RequestFailedError  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from hybridflow.models import tiny_model_dir  # noqa: E402
from hybridflow.parity.config import DEFAULT_THRESHOLDS  # noqa: E402
from hybridflow.parity.logprob import logprob_gaps  # noqa: E402
from hybridflow.service.app import start_service  # noqa: E402
from hybridflow.service.core import TinkerService  # noqa: E402
from hybridflow.service.serve import start as start_tinker  # noqa: E402

KEY = "tml-hybridflow-test"
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "guides", "tinker.md")
BOUNDS = DEFAULT_THRESHOLDS[("native", "fp32")]
TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny_model_dir()
    # "default" as an alias, as `hybridflow tinker` (no --model) answers to it: the docs' loop names it
    service = TinkerService(path, tmp_path_factory.mktemp("tinker-state"), aliases=("default",), max_tokens=64)
    running = start_service(service, "127.0.0.1", 0, api_key=KEY)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(served):
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    yield sc
    sc.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def trainer(client, served):
    return client.create_lora_training_client(base_model=served.service.name, rank=4).result(timeout=60)


@pytest.fixture(scope="module")
def tokens(trainer):
    return trainer.get_tokenizer().encode(TEXT)


def ce_datum(ids: list[int], weights: list[float] | None = None) -> types.Datum:
    weights = weights if weights is not None else [1.0] * (len(ids) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}
    )


def forward_logprobs(tc, ids: list[int]) -> np.ndarray:
    out = tc.forward([ce_datum(ids)], "cross_entropy").result(timeout=60)
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data)


def test_cross_entropy_steps_lower_the_loss_and_forward_changes_nothing(client, served, tokens):
    tc = client.create_lora_training_client(base_model=served.service.name, rank=8).result(timeout=60)
    datum = ce_datum(tokens)
    losses = []
    for _ in range(5):
        fb = tc.forward_backward([datum], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result(timeout=60)
        step.result(timeout=60)
        assert set(out.metrics) == {"loss:sum"}
        per_token = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)
        assert per_token.shape == (len(tokens) - 1,)
        assert out.metrics["loss:sum"] == pytest.approx(-per_token.sum(), rel=1e-5)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] - 2.0 and min(losses[1:]) < losses[0], losses
    # forward_only twice: same numbers, no step taken in between
    first, second = forward_logprobs(tc, tokens), forward_logprobs(tc, tokens)
    np.testing.assert_array_equal(first, second)


def test_rl_losses_train_and_return_logprobs(trainer, tokens):
    n = len(tokens) - 1
    base = forward_logprobs(trainer, tokens)
    adv = np.where(np.arange(n) >= n // 2, 1.0, 0.0).astype(np.float32)
    for loss in ("importance_sampling", "ppo", "cispo"):
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": base.astype(np.float32), "advantages": adv},
        )
        out = trainer.forward_backward([datum], loss).result(timeout=60)
        assert math.isfinite(out.metrics["loss:sum"])
        # at the sampling weights every ratio is 1: the loss is -sum(A)
        if loss != "cispo":
            assert out.metrics["loss:sum"] == pytest.approx(-adv.sum(), abs=1e-3)
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        base = forward_logprobs(trainer, tokens)
    dro = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": base.astype(np.float32), "advantages": adv},
    )
    out = trainer.forward_backward([dro], "dro", loss_fn_config={"beta": 0.1}).result(timeout=60)
    assert out.metrics["loss:sum"] == pytest.approx(-(base * adv).sum(), rel=1e-4)


def test_sampler_snapshot_samples_with_logprobs_at_training_parity(trainer, client, tokens):
    trainer.forward_backward([ce_datum(tokens)], "cross_entropy").result(timeout=60)
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    path = trainer.save_weights_for_sampler("parity").result(timeout=60).path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/parity")
    sampler = client.create_sampling_client(model_path=path)
    prompt = tokens[:5]
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result(timeout=60)
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 12 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length")
        # the training forward over prompt + sample, same weights: per-token log-probs agree within the guard's bounds
        trained = forward_logprobs(trainer, prompt + list(seq.tokens))[len(prompt) - 1 :]
        gaps = logprob_gaps(torch.tensor([trained]), torch.tensor([seq.logprobs]), torch.ones(1, len(trained)), 0.2)
        assert gaps.gap_mean <= BOUNDS.gap_mean and gaps.gap_max <= BOUNDS.gap_max, gaps
    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result(timeout=60)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # same seed, same samples


def test_compute_logprobs_nan_first_and_snapshot_stays_frozen(trainer, client, tokens):
    sampler = trainer.save_weights_and_get_sampling_client()
    before = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=60)
    assert before[0] is None and len(before) == len(tokens)
    trained = forward_logprobs(trainer, tokens)
    np.testing.assert_allclose(np.asarray(before[1:]), trained, atol=BOUNDS.gap_max)
    trainer.forward_backward([ce_datum(tokens)], "cross_entropy").result(timeout=60)
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60)
    after = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=60)
    assert after == before  # the snapshot is frozen
    fresh = trainer.save_weights_and_get_sampling_client()
    moved = fresh.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=60)
    assert moved != before
    base = client.create_sampling_client(base_model=trainer.get_info().model_data.model_name)
    assert base.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=60) != before


def test_save_state_restores_weights_and_optimizer_in_a_new_client(trainer, client, served, tokens):
    path = trainer.save_state("resume").result(timeout=60).path
    assert path.endswith("/weights/resume")
    expected = forward_logprobs(trainer, tokens)
    restored = client.create_training_client_from_state_with_optimizer(path).result(timeout=60)
    np.testing.assert_allclose(forward_logprobs(restored, tokens), expected, atol=1e-6)
    listed = tinker.RestClient(base_url=served.url, api_key=KEY).list_checkpoints(trainer.model_id).result(timeout=30)
    assert path in {c.tinker_path for c in listed.checkpoints}


def expect_user_error(future, match: str) -> None:
    with pytest.raises(RequestFailedError, match=match) as err:
        future.result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.User


def test_bad_requests_fail_their_future_with_a_user_category_and_the_client_goes_on(trainer, tokens):
    expect_user_error(trainer.forward_backward([ce_datum(tokens)], "gspo"), "unknown loss_fn 'gspo'")
    long = [tokens[0]] * 2050  # the tiny model's context is 2048
    expect_user_error(trainer.forward_backward([ce_datum(long)], "cross_entropy"), "more than the model's context")
    expect_user_error(trainer.forward_backward([ce_datum([*tokens[:3], 10**6])], "cross_entropy"), "outside the vocab")
    missing = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    expect_user_error(trainer.forward_backward([missing], "cross_entropy"), "missing \\['weights'\\]")
    trainer.save_weights_for_sampler("taken").result(timeout=60)
    expect_user_error(trainer.save_weights_for_sampler("taken"), "exists already")
    expect_user_error(trainer.load_state("tinker://nope/weights/x"), "does not exist")
    sampler = trainer.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tokens[:4])
    expect_user_error(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, top_p=1.5)), "top_p must be in")
    expect_user_error(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=65)), "more than this service samples")
    expect_user_error(
        sampler.sample(types.ModelInput.from_ints([10**6]), 1, types.SamplingParams(max_tokens=2)), "vocab"
    )
    # the client's later calls still run, in order
    out = trainer.forward_backward([ce_datum(tokens)], "cross_entropy").result(timeout=60)
    assert math.isfinite(out.metrics["loss:sum"])


def _low_level(served):
    return AsyncTinker(base_url=served.url, api_key=KEY, max_retries=0)


async def _outcome(api, request_id: str) -> dict:
    resp = await api.post(
        "/api/v1/retrieve_future", body={"request_id": request_id}, cast_to=object, options={"max_retries": 0}
    )
    return resp


def test_unknown_model_malformed_protobuf_and_reused_seq_id_fail_as_user_errors(served, trainer):
    async def run() -> list[dict]:
        api = _low_level(served)
        fb = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[], loss_fn="cross_entropy"),
            model_id="no-such-model",
            seq_id=1,
        )
        unknown = await api.training.forward_backward(request=fb)
        garbage = await api.post(
            "/api/v1/forward_backward",
            body=b"\xff\xfe not a protobuf",
            cast_to=types.UntypedAPIFuture,
            options={"headers": {"Content-Type": "application/x-protobuf"}},
        )
        session = (
            await api.service.create_session(
                request=types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="t")
            )
        ).session_id
        created = await api.models.create(
            request=types.CreateModelRequest(
                session_id=session, model_seq_id=0, base_model=served.service.name, lora_config=types.LoraConfig(rank=2)
            )
        )
        model_id = (await _outcome(api, created.request_id))["model_id"]
        step = types.OptimStepRequest(adam_params=types.AdamParams(), model_id=model_id, seq_id=1)
        first = await api.training.optim_step(request=step)
        resent = await api.training.optim_step(request=step)  # what the SDK sends when an answer timed out
        other = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=0.5), model_id=model_id, seq_id=1)
        reused = await api.training.optim_step(request=other)
        assert resent.request_id == first.request_id  # the same call: answered once, run once
        snap = [  # the SDK numbers its sampling sessions afresh on every send, resends included
            await api.weights.save_for_sampler(
                request=types.SaveWeightsForSamplerRequest(model_id=model_id, seq_id=2, sampling_session_seq_id=n)
            )
            for n in (5, 6)
        ]
        assert snap[0].request_id == snap[1].request_id
        out = [await _outcome(api, f.request_id) for f in (unknown, garbage, first, reused)]
        await api.close()
        return out

    unknown, garbage, first, reused = asyncio.run(run())
    assert unknown["category"] == "user" and "unknown model_id 'no-such-model'" in unknown["error"]
    assert garbage["category"] == "user" and "not a ForwardBackwardRequest protobuf" in garbage["error"]
    assert "error" not in first
    assert reused["category"] == "user" and "out of order" in reused["error"]


def test_a_wrong_api_key_is_refused_and_other_clients_go_on(served, trainer, tokens):
    async def run():
        api = AsyncTinker(base_url=served.url, api_key="tml-wrong", max_retries=0)
        try:
            await api.service.create_session(
                request=types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="t")
            )
        finally:
            await api.close()

    with pytest.raises(tinker.AuthenticationError, match="missing or wrong X-API-Key"):
        asyncio.run(run())
    assert math.isfinite(trainer.forward([ce_datum(tokens)], "cross_entropy").result(timeout=60).metrics["loss:sum"])


def test_finished_session_frees_its_adapters_but_not_its_checkpoints(served, tokens):
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=served.service.name, rank=2).result(timeout=60)
    path = tc.save_state("kept").result(timeout=60).path
    model_id = tc.model_id
    assert model_id in served.service.registry.models
    sc.close("success").result(timeout=30)
    deadline = time.monotonic() + 30
    while model_id in served.service.registry.models and time.monotonic() < deadline:
        time.sleep(0.1)
    assert model_id not in served.service.registry.models
    other = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    try:
        restored = other.create_training_client_from_state(path).result(timeout=60)
        assert len(forward_logprobs(restored, tokens)) == len(tokens) - 1
    finally:
        other.close("success").result(timeout=30)


def test_a_public_bind_needs_a_key_and_the_sdk_needs_tml_keys():
    with pytest.raises(ValueError, match="without an API key"):
        start_tinker("/no/such/model", host="0.0.0.0")  # refused before the model is looked at
    with pytest.raises(ValueError, match="must start with 'tml-'"):
        start_tinker("/no/such/model", api_key="secret")


@pytest.mark.slow
def test_cli_refuses_a_public_bind_without_a_key():
    proc = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", "tinker", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert proc.returncode == 2 and "without an API key" in proc.stderr


@pytest.mark.slow
def test_cli_serves_the_sdk(tmp_path):
    model = str(tiny_model_dir())
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "tinker", "--model", model, "--state-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving Tinker API at "), line + proc.stderr.read()
        url = line.split()[4]
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=model, rank=2).result(timeout=60)
        ids = tc.get_tokenizer().encode(TEXT)
        assert math.isfinite(tc.forward([ce_datum(ids)], "cross_entropy").result(timeout=60).metrics["loss:sum"])
        sc.close("success").result(timeout=30)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_a_batch_over_the_chunk_limit_arrives_in_chunks_and_sums_like_one(client, served, tokens):
    tc = client.create_lora_training_client(base_model=served.service.name, rank=2).result(timeout=60)
    data = [ce_datum(tokens[i % 5 : i % 5 + 3]) for i in range(1030)]  # the SDK splits at 1024 datums
    whole = tc.forward(data, "cross_entropy").result(timeout=120)
    assert len(whole.loss_fn_outputs) == 1030
    per_datum = [-np.asarray(o["logprobs"].data).sum() for o in whole.loss_fn_outputs]
    assert whole.metrics["loss:sum"] == pytest.approx(sum(per_datum), rel=1e-4)
    first = tc.forward(data[:5], "cross_entropy").result(timeout=60)
    assert [np.asarray(o["logprobs"].data).tolist() for o in first.loss_fn_outputs] == [
        np.asarray(o["logprobs"].data).tolist() for o in whole.loss_fn_outputs[:5]
    ]


async def _loss_sum(api, request_id: str) -> float:
    """The loss:sum of a forward_backward future (a ForwardBackwardOutput protobuf)."""
    resp = await api.post(
        "/api/v1/retrieve_future", body={"request_id": request_id}, cast_to=httpx.Response, options={"max_retries": 0}
    )
    assert resp.headers["content-type"] == "application/x-protobuf", resp.text
    return pb.ForwardBackwardOutput.FromString(resp.content).metrics["loss:sum"]


async def _new_model(api, served, rank: int = 2) -> str:
    """A new session with one training client, through the SDK's low-level client; the client's model_id."""
    session = (
        await api.service.create_session(request=types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="t"))
    ).session_id
    created = await api.models.create(
        request=types.CreateModelRequest(
            session_id=session, model_seq_id=0, base_model=served.service.name, lora_config=types.LoraConfig(rank=rank)
        )
    )
    return (await _outcome(api, created.request_id))["model_id"]


def test_a_session_that_stops_heartbeating_is_freed_after_the_timeout_and_its_checkpoints_stay(served, client, tokens):
    async def create() -> tuple[str, str]:
        api = _low_level(served)
        model_id = await _new_model(api, served)
        save = types.SaveWeightsRequest(model_id=model_id, path="before-vanishing", seq_id=1)
        saved = await _outcome(api, (await api.weights.save(request=save)).request_id)
        await api.close()  # and never heartbeats, nor finishes its session
        return model_id, saved["path"]

    model_id, path = asyncio.run(create())
    service = served.service
    assert model_id in service.registry.models
    silent = service.sessions.get(model_id.split(":train:")[0])
    silent.last_seen -= service.sessions.timeout_s + 1  # as if its last heartbeat were that long ago
    service.reap_sessions()  # what the reaper thread does every 10 s
    deadline = time.monotonic() + 30
    while model_id in service.registry.models and time.monotonic() < deadline:
        time.sleep(0.1)
    assert model_id not in service.registry.models
    assert model_id not in service.registry.peft.peft_config  # the adapter itself is gone, not just its entry
    restored = client.create_training_client_from_state(path).result(timeout=60)
    assert len(forward_logprobs(restored, tokens)) == len(tokens) - 1


def _fb_request(model_id: str, seq_id: int, ids: list[int]) -> types.ForwardBackwardRequest:
    return types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[ce_datum(ids)], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )


def test_calls_that_arrive_out_of_seq_id_order_run_in_seq_id_order(served, tokens):
    async def run() -> tuple[dict, dict, dict]:
        api = _low_level(served)
        model_id = await _new_model(api, served)
        fb = _fb_request(model_id, 1, tokens)
        step = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=1e-3), model_id=model_id, seq_id=2)
        fwd = _fb_request(model_id, 3, tokens)
        # sent last-first: the forward (3) must still see the step (2) taken on the gradients of (1)
        third = await api.training.forward_backward(request=fwd, forward_only=True)
        second = await api.training.optim_step(request=step)
        first = await api.training.forward_backward(request=fb)
        out = [await _loss_sum(api, first.request_id), await _outcome(api, second.request_id)]
        out.append(await _loss_sum(api, third.request_id))
        await api.close()
        return tuple(out)

    first, second, third = asyncio.run(run())
    assert "error" not in second, second
    assert third < first - 0.1, (first, third)  # seq order: the forward ran after the step


def test_a_seq_id_gap_that_never_fills_fails_the_held_calls_naming_the_missing_one(served):
    scheduler = served.service.scheduler
    saved, scheduler.gap_timeout_s = scheduler.gap_timeout_s, 1.0
    try:

        async def run() -> dict:
            api = _low_level(served)
            model_id = await _new_model(api, served)
            step = types.OptimStepRequest(adam_params=types.AdamParams(), model_id=model_id, seq_id=2)
            held = await api.training.optim_step(request=step)  # seq_id 1 never comes
            out = await _outcome(api, held.request_id)
            await api.close()
            return out

        held = asyncio.run(run())
    finally:
        scheduler.gap_timeout_s = saved
    assert held["category"] == "user" and "seq_id 1 of model" in held["error"] and "never arrived" in held["error"]


def test_an_unknown_base_model_is_a_user_error_naming_the_served_one(client, served, trainer, tokens):
    with pytest.raises(RequestFailedError, match="unknown base_model 'no/such-model'") as err:
        client.create_lora_training_client(base_model="no/such-model", rank=2).result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.User and served.service.name in str(err.value)
    assert math.isfinite(trainer.forward([ce_datum(tokens)], "cross_entropy").result(timeout=60).metrics["loss:sum"])


def test_freeing_the_first_client_leaves_the_others_served(tmp_path, tokens):
    # peft keeps the first adapter's name as the wrapper's active adapter unless told otherwise: freeing that
    # client once broke every later forward of every client (found by the cookbook recipes, one after another)
    service = TinkerService(tiny_model_dir(), tmp_path, max_tokens=16)
    running = start_service(service, "127.0.0.1", 0, api_key=KEY)
    try:
        first = tinker.ServiceClient(base_url=running.url, api_key=KEY)
        tc = first.create_lora_training_client(base_model=service.name, rank=2).result(timeout=60)
        tc.forward_backward([ce_datum(tokens)], "cross_entropy").result(timeout=60)
        first.close("success").result(timeout=30)
        deadline = time.monotonic() + 30
        while service.registry.models and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not service.registry.models
        second = tinker.ServiceClient(base_url=running.url, api_key=KEY)
        other = second.create_lora_training_client(base_model=service.name, rank=2).result(timeout=60)
        out = other.forward_backward([ce_datum(tokens)], "cross_entropy").result(timeout=60)
        other.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        assert math.isfinite(out.metrics["loss:sum"])
        sampler = other.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=4)
        assert len(sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, params).result(timeout=60).sequences) == 1
        second.close("success").result(timeout=30)
    finally:
        running.stop()


def test_concurrent_samples_of_one_sampler_run_as_one_batch(trainer, served, tokens):
    sampler = trainer.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=6, temperature=0.7)
    before = len(served.service.scheduler.batch_sizes)
    futures = [
        sampler.sample(types.ModelInput.from_ints(tokens[: 3 + i]), num_samples=2, sampling_params=params)
        for i in range(6)
    ]
    results = [f.result(timeout=120) for f in futures]
    assert all(len(r.sequences) == 2 and all(1 <= len(s.tokens) <= 6 for s in r.sequences) for r in results)
    sizes = served.service.scheduler.batch_sizes[before:]
    assert sum(sizes) == 6 and max(sizes) > 1, sizes


def test_the_docs_loop_runs_against_the_service(served, capsys):
    text = open(DOCS).read()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    code = code.replace("http://127.0.0.1:8000", served.url).replace('"tml-local"', repr(KEY))
    exec(compile(code, "docs/guides/tinker.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[1]) for line in lines[:5]]
    assert [int(line.split()[0]) for line in lines[:5]] == list(range(5)) and all(map(math.isfinite, losses))
    assert len(lines) == 7 and all(x.rsplit(" ", 2)[1] in ("stop", "length") for x in lines[5:]), lines


def test_a_snapshot_whose_weights_break_log_prob_parity_fails_with_a_server_error(trainer, client, served, tokens):
    from safetensors.torch import load_file, save_file

    trainer.forward_backward([ce_datum(tokens)], "cross_entropy").result(timeout=60)
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    path = trainer.save_weights_for_sampler("tampered").result(timeout=60).path
    run, kind, name = path.removeprefix("tinker://").split("/")
    adapter = served.service.checkpoints.root / run / kind / name / "adapter.safetensors"
    state = load_file(str(adapter))
    save_file({k: v * 3 if ".lora_B." in k else v for k, v in state.items()}, str(adapter))  # not what was trained
    sampler = client.create_sampling_client(model_path=path)
    with pytest.raises(RequestFailedError, match="log-prob parity breach") as err:
        sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=4)).result(timeout=60)
    assert err.value.category == types.RequestErrorCategory.Server
    fine = client.create_sampling_client(model_path=trainer.save_weights_for_sampler("untouched").result().path)
    assert (
        len(
            fine.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=4))
            .result()
            .sequences
        )
        == 1
    )


def test_forward_backward_custom_runs_its_loss_on_the_client_over_the_served_logprobs(trainer, tokens):
    def loss_fn(data, logprobs_list):
        loss = -sum(lp.sum() for lp in logprobs_list)  # cross-entropy, written as a custom loss
        return loss, {"custom:sum": float(loss)}

    out = trainer.forward_backward_custom([ce_datum(tokens)], loss_fn).result(timeout=60)
    expected = -forward_logprobs(trainer, tokens).sum()
    assert out.metrics["custom:sum"] == pytest.approx(expected, rel=1e-4)
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert -forward_logprobs(trainer, tokens).sum() < expected  # its gradient reached the adapter
