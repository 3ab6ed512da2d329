"""Loopback load on `hybridflow serve`: good requests beside every hostile request of issue 56 (the load test).

    .venv/bin/python bench/serve_load.py                           # tiny random Llama, 16 clients, 2 rounds
    .venv/bin/python bench/serve_load.py --model default --rounds 1 --clients 8   # SmolLM2-135M-Instruct

Starts `hybridflow serve` as its own process on 127.0.0.1 (a free port), warms it up with good requests, reads
its resident memory (VmRSS), then runs `--rounds` rounds on `--clients` threads: in each round every hostile
request (`HOSTILE`, sent raw with httpx2 so that it can be malformed) goes out beside `--good` good requests made
with the `openai` client (chat and completions, small `max_tokens`). Afterwards it checks that the server still
answers and reads its memory again. It prints the statuses per kind, the good requests' latencies, the RSS before
and after, and a one-line summary; `run_load` returns them (tests/test_serve_load.py asserts on them). The server
process is stopped with SIGTERM at the end and the seconds it took to exit are printed too.
"""

from __future__ import annotations

import argparse
import json
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2
import openai

from hybridflow.models import tiny_model_dir
from hybridflow.utils.hardware import cpu_signature

REPO = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


def start_serve(model: str, max_tokens: int = 8, limits: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`hybridflow serve` on a free loopback port; (the process, its OpenAI base URL) once it listens."""
    command = [sys.executable, "-m", "hybridflow.cli.main", "serve", "--model", model, "--port", "0"]
    command += ["--max-tokens", str(max_tokens), *limits]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=300)
    except queue.Empty:
        proc.kill()
        raise RuntimeError("hybridflow serve printed no URL within 300 s") from None
    if not line.startswith("serving ") or " at http://" not in line:
        proc.kill()
        raise RuntimeError(f"hybridflow serve did not start: {line!r}")
    return proc, line.split(" at ")[-1].strip()


def rss_mib(pid: int) -> float:
    """The process's resident memory (VmRSS) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _raw(path: str, body: bytes | str) -> Callable[[str], int]:
    data = body.encode() if isinstance(body, str) else body

    def send(url: str) -> int:
        headers = {"content-type": "application/json", "authorization": "Bearer hostile"}
        return httpx2.post(url + path, content=data, headers=headers, timeout=60).status_code

    return send


def _chat(**fields: Any) -> str:
    return json.dumps({"model": "m", "messages": CHAT, "max_tokens": 4, **fields}, allow_nan=True)


def _big_body() -> bytes:
    """A 64 MiB chat request (built when sent, not at import)."""
    return b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (64 << 20) + b'"}]}'


def _chunked_body(url: str) -> int:
    """64 MiB without a Content-Length: refused once `max_body_bytes` have come."""
    chunks = (b"x" * (1 << 20) for _ in range(64))
    return httpx2.post(url + "/chat/completions", content=chunks, timeout=60).status_code


HOSTILE: dict[str, Callable[[str], int]] = {
    "temperature NaN": _raw("/chat/completions", _chat(temperature=float("nan"))),
    "temperature Infinity": _raw("/chat/completions", _chat(temperature=float("inf"))),
    "top_p NaN": _raw("/chat/completions", _chat(top_p=float("nan"))),
    "max_tokens Infinity": _raw("/chat/completions", _chat(max_tokens=float("inf"))),
    "n=10**7": _raw("/chat/completions", _chat(n=10**7)),
    "n=1e308": _raw("/chat/completions", _chat(n=1e308)),
    "content a dict": _raw("/chat/completions", _chat(messages=[{"role": "user", "content": {"a": 1}}])),
    "messages not a list": _raw("/chat/completions", _chat(messages="hi")),
    "missing role": _raw("/chat/completions", _chat(messages=[{"content": "hi"}])),
    "10,000 stop strings": _raw("/chat/completions", _chat(stop=[f"s{i}" for i in range(10_000)])),
    "a 100,000-char stop string": _raw("/chat/completions", _chat(stop=["x" * 100_000])),
    "token ids out of range": _raw(
        "/completions", json.dumps({"model": "m", "prompt": [1, 10**9, 5], "max_tokens": 4})
    ),
    "negative token ids": _raw("/completions", json.dumps({"model": "m", "prompt": [1, -3], "max_tokens": 4})),
    "1,000 prompts": _raw("/completions", json.dumps({"model": "m", "prompt": ["a"] * 1000, "max_tokens": 4})),
    "a 64 MiB body": lambda url: _raw("/chat/completions", _big_body())(url),
    "64 MiB chunked, no length": _chunked_body,
    "not JSON": _raw("/chat/completions", "{not json"),
    "JSON nested 100,000 deep": _raw("/chat/completions", "[" * 100_000 + "]" * 100_000),
    "a 100,000-token prompt": _raw(
        "/completions", json.dumps({"model": "m", "prompt": [5] * 100_000, "max_tokens": 4})
    ),
    "a 1 MiB session id": _raw("/chat/completions", _chat(session_id="s" * (1 << 20))),
}
"""Each hostile request of issue 56 (and a few of the same family): name -> send(base_url) -> HTTP status."""


def _good(client: openai.OpenAI, i: int) -> tuple[int, float]:
    """One good request (chat, chat with content parts, or a completion); (its status, seconds)."""
    start = time.perf_counter()
    try:
        if i % 3 == 0:
            client.completions.create(model="m", prompt="The capital of France is", max_tokens=4)
        else:
            content = "What is 2 + 3?" if i % 3 == 1 else [{"type": "text", "text": "What is 2 + 3?"}]
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": content}],
                max_tokens=4,
                extra_headers={"x-session-id": f"g{i}"},
            )
        status = 200
    except openai.APIStatusError as err:
        status = err.status_code
    except openai.APIConnectionError:
        status = 0
    return status, time.perf_counter() - start


def _hostile(send: Callable[[str], int], url: str) -> int:
    try:
        return send(url)
    except httpx2.HTTPError:
        return 0  # no answer at all (connection reset): counted as a failure of the server


def run_load(url: str, pid: int, clients: int = 16, rounds: int = 2, good: int = 3) -> dict[str, Any]:
    """Good and hostile requests against the server at `url` (process `pid`); the statuses and RSS (module docstring)."""
    client = openai.OpenAI(base_url=url, api_key="sk-load", max_retries=0, timeout=120)
    for i in range(3):  # warm-up: every kind of good request once
        _good(client, i)
    rss_before = rss_mib(pid)
    hostile: dict[str, Counter] = {name: Counter() for name in HOSTILE}
    good_status: Counter = Counter()
    latencies: list[float] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(rounds):
            futures = []
            for index, (name, send) in enumerate(HOSTILE.items()):
                futures.append((name, pool.submit(_hostile, send, url)))
                futures += [(None, pool.submit(_good, client, index * good + k)) for k in range(good)]
            for name, future in futures:
                if name is None:
                    status, seconds = future.result()
                    good_status[status] += 1
                    latencies.append(seconds)
                else:
                    hostile[name][future.result()] += 1
    elapsed = time.perf_counter() - start
    after_status, _ = _good(client, 0)
    models_status = httpx2.get(url + "/models", timeout=30).status_code
    return {
        "rounds": rounds,
        "clients": clients,
        "good": dict(good_status),
        "hostile": {name: dict(counts) for name, counts in hostile.items()},
        "after": after_status,
        "models_after": models_status,
        "rss_before_mib": rss_before,
        "rss_after_mib": rss_mib(pid),
        "seconds": elapsed,
        "good_p50_s": statistics.median(latencies),
        "good_max_s": max(latencies),
    }


def stop_seconds(proc: subprocess.Popen, timeout_s: float = 60.0) -> tuple[float, int]:
    """SIGTERM `proc`; (seconds until it exited, its exit code)."""
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=timeout_s)
    return time.perf_counter() - start, code


def stop_while_busy(proc: subprocess.Popen, url: str, requests: int = 4, wait_s: float = 3.0) -> dict[str, Any]:
    """Send `requests` long completions (n=16, up to 2000 tokens each: minutes of generation on a CPU), SIGTERM the
    server `wait_s` seconds later, and return the seconds it took to exit, its exit code, and what each client got
    (a status, or the name of the httpx2 error) and how many had an answer before the signal."""
    answers: list[int | str] = []

    def busy() -> None:
        body = {"model": "m", "prompt": "Once upon a time", "n": 16, "max_tokens": 2000, "temperature": 1.0}
        try:
            answers.append(httpx2.post(url + "/completions", json=body, timeout=120).status_code)
        except httpx2.HTTPError as err:
            answers.append(type(err).__name__)

    clients = [threading.Thread(target=busy, daemon=True) for _ in range(requests)]
    for client in clients:
        client.start()
    time.sleep(wait_s)
    answered_before = len(answers)
    stop_s, code = stop_seconds(proc)
    for client in clients:
        client.join(timeout=30)
    return {"stop_s": stop_s, "exit_code": code, "answers": answers, "answered_before_stop": answered_before}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(tiny_model_dir("llama")), help="HF directory or 'default'")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--good", type=int, default=3, help="good requests beside each hostile one")
    args = parser.parse_args(argv)
    print(f"cpu: {cpu_signature()}", flush=True)
    print("command: " + shlex.join(["python", "bench/serve_load.py", *(sys.argv[1:] if argv is None else argv)]))
    proc, url = start_serve(args.model, max_tokens=2000)
    try:
        result = run_load(url, proc.pid, args.clients, args.rounds, args.good)
        result.update(stop_while_busy(proc, url))
    finally:
        if proc.poll() is None:
            proc.kill()
    width = max(len(name) for name in HOSTILE)
    for name, counts in result["hostile"].items():
        print(f"{name:>{width}}  {counts}")
    total_hostile = sum(sum(c.values()) for c in result["hostile"].values())
    print(
        f"summary: {sum(result['good'].values())} good requests {result['good']}, {total_hostile} hostile (statuses above), "
        f"{args.clients} clients, {result['seconds']:.1f} s; good latency p50 {result['good_p50_s']:.2f} s, "
        f"max {result['good_max_s']:.2f} s; after: chat {result['after']}, models {result['models_after']}; "
        f"server RSS {result['rss_before_mib']:.0f} -> {result['rss_after_mib']:.0f} MiB; "
        f"SIGTERM while generating ({result['answered_before_stop']} of 4 long requests answered before it): exit in "
        f"{result['stop_s']:.2f} s (code {result['exit_code']}), the long requests got {Counter(result['answers'])}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
