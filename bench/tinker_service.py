"""Sampling through the Tinker service (the real `tinker` SDK over HTTP) vs the native rollout called in-process,
same model, same prompts, same rows, side by side (issue 53: the service must reach >= 0.8x).

    .venv/bin/python bench/tinker_service.py                 # SmolLM2-135M-Instruct, 8 prompts x 1 sample, 64 tokens
    .venv/bin/python bench/tinker_service.py --tiny --rounds 1   # tiny random model: checks that it runs

Each round runs both sides one after the other on the base model's weights, sampling at T=1 with EOS on:
- `native`: one `RolloutBackend.generate` call on every prompt (what `hybridflow serve` and the trainer's
  rollout run), in this process;
- `service`: `hybridflow tinker` started as its own process on 127.0.0.1 (as a user runs it: the SDK client
  and the server do not share a Python interpreter), a `SamplingClient` in this process submitting every prompt
  as its own `sample` request at once and waiting for all; the service batches concurrent requests of one
  sampler into one generate call (tests/test_tinker_service.py checks that it does).
Tokens/s counts sampled tokens over the wall time (the service's: from the first submit to the last result,
HTTP, protobuf and polling included). The ratio is service over native in the same round; median and min over
rounds. One warm-up call per side comes first. Only ratios within one run mean anything on a shared CPU.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hybridflow.endpoint.backend import GenerationRequest
from hybridflow.endpoint.rollout_backend import load_rollout_backend
from hybridflow.models import load_tokenizer, resolve_model_path, tiny_model_dir
from hybridflow.rollout.config import SamplingParams
from hybridflow.utils.hardware import cpu_signature, describe_cpu

KEY = "tml-bench"


def prompts(path, rows: int) -> list[list[int]]:
    tok = load_tokenizer(path)
    out = []
    for i in range(rows):
        messages = [{"role": "user", "content": f"What is {17 + i} times {23 + 2 * i}? Explain step by step."}]
        out.append(
            list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        )
    return out


def native_round(backend, batch: list[list[int]], max_tokens: int) -> tuple[int, float]:
    backend.sampling = SamplingParams(temperature=1.0)
    start = time.perf_counter()
    samples = backend.generate([GenerationRequest(p, max_tokens) for p in batch])
    wall = time.perf_counter() - start
    return sum(len(s[0].token_ids) for s in samples), wall


def service_round(sampler, batch: list[list[int]], max_tokens: int) -> tuple[int, float]:
    from tinker import types  # noqa: PLC0415  (the bench's one optional import)

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    start = time.perf_counter()
    futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=1, sampling_params=params) for p in batch]
    results = [f.result(timeout=600) for f in futures]
    wall = time.perf_counter() - start
    return sum(len(r.sequences[0].tokens) for r in results), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random model (a smoke run)")
    parser.add_argument("--rows", type=int, default=8, help="prompts per round (1 sample each)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import tinker  # noqa: PLC0415

    path = tiny_model_dir() if args.tiny else resolve_model_path("default")
    print(f"cpu: {cpu_signature()} (matmul probe skipped: --tiny)" if args.tiny else describe_cpu(), flush=True)
    print("command: " + shlex.join(["python", "bench/tinker_service.py", *(sys.argv[1:] if argv is None else argv)]))
    print(f"model: {path}  rows: {args.rows}  max_tokens: {args.max_tokens}  torch threads: {torch.get_num_threads()}")
    batch = prompts(path, args.rows)
    backend = load_rollout_backend(path, max_tokens=args.max_tokens, dtype="fp32")
    server = start_server(str(path), args.max_tokens)
    try:
        url = server.stdout.readline().split()[4]
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        sampler = client.create_sampling_client(base_model=str(path))
        native_round(backend, batch[:2], 4)
        service_round(sampler, batch[:2], 4)
        ratios, rows = [], []
        for r in range(args.rounds):
            n_tok, n_wall = native_round(backend, batch, args.max_tokens)
            s_tok, s_wall = service_round(sampler, batch, args.max_tokens)
            ratio = (s_tok / s_wall) / (n_tok / n_wall)
            ratios.append(ratio)
            rows.append((r, n_tok, n_tok / n_wall, s_tok, s_tok / s_wall, ratio))
        print(f"{'round':>5} {'native tok':>10} {'native tok/s':>12} {'svc tok':>8} {'svc tok/s':>10} {'ratio':>6}")
        for r, n_tok, n_tps, s_tok, s_tps, ratio in rows:
            print(f"{r:5d} {n_tok:10d} {n_tps:12.1f} {s_tok:8d} {s_tps:10.1f} {ratio:6.3f}")
        print(f"service / native tokens/s: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}")
        client.close("success").result(timeout=30)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return 0


def start_server(model: str, max_tokens: int) -> subprocess.Popen:
    """`hybridflow tinker` on a free port; its first stdout line names the URL."""
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "tinker", "--model", model, "--api-key", KEY]
    cmd += ["--max-tokens", str(max_tokens), "--state-dir", tempfile.mkdtemp(prefix="tinker-bench-")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


if __name__ == "__main__":
    sys.exit(main())
