"""The loopback load test of `hybridflow serve` (issue 56): the real server process on the tiny model, real clients
(`openai`, httpx2), every hostile request of the issue beside good ones (bench/serve_load.py drives both), and
SIGTERM while it generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hybridflow.models import tiny_model_dir

_PATH = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("bench_serve_load", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # a model-loading server process (~16 s) and 20 hostile kinds x 4 requests
def test_hostile_requests_get_4xx_alone_good_ones_200_and_memory_stays_bounded(load):
    proc, url = load.start_serve(str(tiny_model_dir("llama")))
    try:
        result = load.run_load(url, proc.pid, clients=8, rounds=1, good=3)
        stop_s, code = load.stop_seconds(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result["good"] == {200: 3 * len(load.HOSTILE)}, result
    for name, statuses in result["hostile"].items():
        assert len(statuses) == 1 and 400 <= next(iter(statuses)) < 500, (name, statuses)
    assert result["hostile"]["a 64 MiB body"] == {413: 1} and result["hostile"]["n=10**7"] == {400: 1}
    assert result["after"] == 200 and result["models_after"] == 200
    assert result["rss_after_mib"] - result["rss_before_mib"] < 128, result  # a 64 MiB body was never held
    assert code == 0 and stop_s < 10


@pytest.mark.slow  # a model-loading server process (~16 s)
def test_sigterm_stops_a_busy_server_within_seconds(load):
    proc, url = load.start_serve(str(tiny_model_dir("llama")), max_tokens=2000)
    try:
        result = load.stop_while_busy(proc, url, requests=4, wait_s=3.0)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result["answered_before_stop"] == 0, result  # it was generating when the signal came
    assert result["exit_code"] == 0 and result["stop_s"] < 10, result
    assert len(result["answers"]) == 4, result  # every client got an answer or a closed connection, none hangs
    assert all(a == 503 or a in ("RemoteProtocolError", "ReadError") for a in result["answers"]), result
