"""`hybridflow tinker`: build the service for a model directory and serve it until stopped."""

from __future__ import annotations

import threading

from hybridflow.endpoint.app import check_bind
from hybridflow.models import cache_root, resolve_model_path
from hybridflow.service.app import RunningService, start_service
from hybridflow.service.core import TinkerService


def check_api_key(api_key: str | None) -> None:
    """The SDK sends only keys that start with `tml-`: refuse any other before loading the model."""
    if api_key is not None and not api_key.startswith("tml-"):
        raise ValueError(
            f"--api-key must start with 'tml-' (the tinker SDK refuses other keys), got {api_key[:4]!r}..."
        )


def start(
    model: str = "default",
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    state_dir: str | None = None,
    max_tokens: int = 2048,
) -> RunningService:
    """Load `model` ('default': the bundled SmolLM2) and serve it; returns once it listens."""
    check_bind(host, api_key)  # before loading the model: a refused bind fails fast
    check_api_key(api_key)
    path = resolve_model_path(model)
    state = state_dir or str(cache_root() / "tinker")
    service = TinkerService(path, state, aliases=(model,), max_tokens=max_tokens)
    return start_service(service, host, port, api_key)


def serve_until(running: RunningService, stop: threading.Event) -> None:
    """Block until `stop` is set (a signal) or the server exits, then shut it down."""
    try:
        running.wait(stop)
    finally:
        running.stop()
