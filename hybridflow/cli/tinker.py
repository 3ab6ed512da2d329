"""`hybridflow tinker`: the Tinker-compatible training service (hybridflow/service/), until interrupted."""

from __future__ import annotations

import argparse
import signal
import threading

from hybridflow.service.serve import serve_until, start


def cmd_tinker(args: argparse.Namespace) -> int:
    """Serve the Tinker API until interrupted; prints the SDK's base_url and model name once it listens."""

    running = start(args.model, args.host, args.port, args.api_key, args.state_dir, args.max_tokens)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"serving Tinker API at {running.url} base_model={running.service.name}", flush=True)
    serve_until(running, stop)
    return 0
