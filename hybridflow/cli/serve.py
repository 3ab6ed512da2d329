"""`hybridflow serve`: the OpenAI-compatible endpoint (hybridflow/endpoint/) over a model, until interrupted."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from hybridflow.endpoint.app import AgentServer, ServerConfig, check_bind, start_server
from hybridflow.endpoint.limits import parse_limits
from hybridflow.endpoint.rollout_backend import load_rollout_backend
from hybridflow.models import load_tokenizer, resolve_model_path


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model over the OpenAI API until interrupted; prints the base URL once it listens."""

    check_bind(args.host, args.api_key)  # before loading the model: a refused bind or a bad limit fails fast
    limits = parse_limits(args.limits)
    path = resolve_model_path(args.model)
    backend = load_rollout_backend(path, max_tokens=args.max_tokens, dtype=args.dtype, seed=args.seed)
    config = ServerConfig(
        args.served_name or str(args.model), args.api_key, args.on_mismatch, max_sessions=1000, limits=limits
    )
    running = start_server(AgentServer(backend, load_tokenizer(path), config), args.host, args.port)
    # Ctrl-C (or SIGTERM) is how a user stops the server: exit 0. A handler setting an event, rather than the
    # KeyboardInterrupt, which can land inside a Thread.join and leave that thread's lock held.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"serving {path} at {running.url}", flush=True)
    try:
        running.wait(stop)
    finally:
        running.stop()
    if running.server.batcher.running:  # a generation still runs on its daemon thread: interpreter shutdown under a
        sys.stdout.flush()  # running torch op aborts the process (std::terminate), so leave without that shutdown
        sys.stderr.flush()
        os._exit(0)
    return 0
