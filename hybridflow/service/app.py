"""The Tinker API over HTTP (FastAPI): routes under /api/v1, the API key, and the server thread.

Every body is JSON except forward_backward's (a ForwardBackwardRequest protobuf, zstd only if the client config
asked) and the results of forward_backward and asample (protobuf, answered when the poll sends
`Accept: application/x-protobuf`). With an API key set, every request needs `X-API-Key: <key>` (401
otherwise); the SDK only sends keys that start with `tml-`. `check_bind` refuses a non-loopback host without
a key, as `hybridflow serve` does.

Endpoints: client/config, create_session, session_heartbeat, sessions/{id}/finish, create_model, get_info,
forward_backward, optim_step, save_weights, save_weights_for_sampler, load_weights, create_sampling_session,
samplers/{id}, asample, retrieve_future, training_runs/{id}/checkpoints, get_server_capabilities, healthz, telemetry.
telemetry is accepted and dropped; client/dynamic_config answers 404, which the SDK takes as "not served".
A resent request gets its first copy's answer (`once`, replays.py), so the SDK's retries never run a call twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hybridflow.endpoint.app import check_bind
from hybridflow.service.core import TinkerService
from hybridflow.service.errors import UserError
from hybridflow.service.replays import Replays
from hybridflow.service.wire import WireError, decode_forward_backward

log = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
REAP_EVERY_S = 10.0


def build_app(service: TinkerService, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `service` (module docstring)."""
    app = FastAPI(title="hybridflow Tinker service")
    replays = Replays()

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and not secrets.compare_digest(request.headers.get("x-api-key", ""), api_key):
            return JSONResponse({"error": "missing or wrong X-API-Key"}, status_code=401)
        return await call_next(request)

    def once(request: Request, answer: Callable[[], Any], seq: tuple[str, Any] | None = None, raw: bytes = b"") -> Any:
        """`answer()`, or for a resent request the first copy's answer (replays.py). A resend is known by its
        X-Idempotency-Key (the SDK's HTTP retries) or, for a call in a training client's sequence (`seq`: its
        model_id and seq_id), by the same seq_id with the same body, `raw` (the SDK resends a call whose answer
        timed out as a new request with a new key); the same seq_id with another body stays an out-of-order error."""
        keys = [request.headers.get("x-idempotency-key") or ""]
        if seq is not None and seq[1] is not None:
            keys.append(f"{request.url.path} {seq[0]} {seq[1]} {hashlib.sha256(raw).hexdigest()}")
        keys = [k for k in keys if k]
        for key in keys:
            if (hit := replays.get(key)) is not None:
                log.info("answered a resent %s (%s) with its first answer", request.url.path, key)
                return hit
        out = answer()
        for key in keys:
            replays.put(key, out)
        return out

    def future(rid: str, model_id: str | None = None) -> dict[str, Any]:
        return {"request_id": rid, "model_id": model_id} if model_id else {"request_id": rid}

    async def body_of(request: Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def bad_json(where: str) -> JSONResponse:
        return JSONResponse(future(service.failed(f"{where}: the body is not a JSON object")))

    def user_error(err: Exception, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": str(err), "category": "user"}, status_code=status)

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {"use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}  # accepted and dropped: the service keeps no SDK telemetry

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        model = {"model_name": service.name, "max_context_length": service.registry.context_length}
        return {"supported_models": [{**model, "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        return once(request, lambda: {"type": "create_session", "session_id": service.sessions.create()})

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = await body_of(request) or {}
        if not service.sessions.touch(body.get("session_id", "")):
            return user_error(UserError(f"unknown or ended session {body.get('session_id')!r}"), 404)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str):
        service.sessions.finish(session_id)  # idempotent: a session already freed (timed out) is finished too
        service.reap_sessions()
        return Response(status_code=204)

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await body_of(request)
        if body is None:
            return bad_json("create_model")
        return once(request, lambda: future(service.create_model(body)))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = await body_of(request) or {}
        try:
            return service.get_info(body.get("model_id", ""))
        except UserError as err:
            return user_error(err, 404)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        raw = await request.body()
        try:
            body = decode_forward_backward(raw, request.headers.get("content-encoding"))
        except WireError as err:
            return future(service.failed(str(err)))
        seq = (body.model_id, body.seq_id)
        return once(request, lambda: future(service.forward_backward(body), body.model_id), seq, raw)

    def json_route(path: str, method):
        async def route(request: Request):
            body = await body_of(request)
            if body is None:
                return bad_json(path)
            seq = (body.get("model_id"), body.get("seq_id"))
            return once(request, lambda: future(method(body), body.get("model_id")), seq, _resend_digest(body))

        app.post("/api/v1/" + path)(route)

    json_route("optim_step", service.optim_step)
    json_route("save_weights", service.save_weights)
    json_route("save_weights_for_sampler", service.save_weights_for_sampler)
    json_route("load_weights", service.load_weights)

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        body = await body_of(request)
        if body is None:
            return bad_json("asample")

        def answer() -> dict[str, Any]:
            rid = service.asample(body)
            n = max(int(body.get("num_samples", 1) or 1), 1)
            return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}

        return once(request, answer)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        try:
            body = await body_of(request) or {}
            return once(request, lambda: service.create_sampling_session(body))
        except UserError as err:
            return user_error(err)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        try:
            return service.get_sampler(sampler_id)
        except UserError as err:
            return user_error(err, 404)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str):
        return service.list_checkpoints(run_id)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await body_of(request) or {}
        rid = body.get("request_id", "")
        if not service.futures.known(rid):
            return user_error(UserError(f"unknown request_id {rid!r} (never issued, or expired)"), 404)
        outcome = await service.futures.wait(rid)
        if outcome is None:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        if outcome.error is not None:
            return {"error": outcome.error, "category": outcome.category}
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTO)
        return outcome.json

    return app


RESEND_VARIES = ("sampling_session_seq_id",)
"""Body keys the SDK numbers afresh each time it sends a call, resends included."""


def _resend_digest(body: dict[str, Any]) -> bytes:
    """What a JSON call's resend has in common with the first copy: the body less `RESEND_VARIES`."""
    return json.dumps({k: v for k, v in body.items() if k not in RESEND_VARIES}, sort_keys=True).encode()


class RunningService:
    """A uvicorn server and the session reaper on background threads (`start_service`)."""

    def __init__(self, service: TinkerService, userver: Any, thread: threading.Thread, host: str) -> None:
        self.service, self._uvicorn, self._thread, self.host = service, userver, thread, host
        self.port = int(userver.servers[0].sockets[0].getsockname()[1])
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="hybridflow-tinker-reaper", daemon=True)
        self._reaper.start()

    @property
    def url(self) -> str:
        """The SDK's base_url."""
        return f"http://{self.host}:{self.port}"

    def _reap(self) -> None:
        while not self._stop.wait(REAP_EVERY_S):
            self.service.reap_sessions()

    def wait(self, stop: threading.Event | None = None) -> None:
        """Block until the server exits or `stop` is set."""
        while self._thread.is_alive() and not (stop is not None and stop.wait(0.5)):
            if stop is None:
                self._thread.join(timeout=1.0)

    def stop(self) -> None:
        self._stop.set()
        self._uvicorn.should_exit = True
        self._thread.join(timeout=30)
        self.service.close()


def start_service(
    service: TinkerService, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, timeout_s=30.0
) -> RunningService:
    """Serve `service` on host:port (0: a free port) from a daemon thread; returns once it listens."""
    check_bind(host, api_key)
    config = uvicorn.Config(
        build_app(service, api_key),
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    userver = uvicorn.Server(config)
    thread = threading.Thread(target=userver.run, name="hybridflow-tinker-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not userver.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the Tinker service did not start on {host}:{port} (port taken?)")
        time.sleep(0.01)
    return RunningService(service, userver, thread, host)
