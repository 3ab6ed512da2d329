"""The `hybridflow` command: train, sft, data, export, generate, serve.

hybridflow train [--config FILE] key=value ...   # PPO / GRPO run (defaults: the main job)
hybridflow sft [--config FILE] key=value ...     # supervised fine-tuning (hybridflow/cli/sft.py)
hybridflow dpo [--config FILE] key=value ...     # preference optimisation (hybridflow/cli/dpo.py)
hybridflow data TASK --out DIR [--sft | --preference [--rejected-model M]] [--train-size N] [--test-size N] [--seed S] [key=value ...]
hybridflow export CKPT_DIR --out HF_DIR [--tokenizer PATH] [--base-model PATH] [--adapter]
hybridflow plan [--config FILE] --profile PROFILE.json [key=value ...]  # rank placements (cli/plan.py)
hybridflow profile --model M [--out device_profile.json]  # per-token operator costs here (cli/profile.py)
hybridflow generate --model PATH_OR_CKPT --data FILE.parquet [--n N] [--temperature T] [--top-p P] [--top-k K]
                    [--seed S] [--rollout native|hf|vllm] [--out FILE.jsonl]  # greedy unless a sampling flag or --n > 1
hybridflow serve [--model M] [--host 127.0.0.1] [--port 0] [--api-key K] [LIMIT=V ...]  # OpenAI-compatible server (endpoint/app.py)

hybridflow tinker [--model M] [--host 127.0.0.1] [--port 0] [--api-key tml-K]  # Tinker API service (service/)

train, sft and dpo: --list-keys [PREFIX] prints the config keys with type, default and doc.
Errors: a user error prints one line (exit 2); any other error prints one line and the path of a file holding its
traceback (exit 1); --debug, anywhere on the command line, prints the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import yaml

from hybridflow.cli.args import (
    DPO_DESCRIPTION,
    DPO_PROG,
    ROLLOUT_NAMES,
    SFT_DESCRIPTION,
    SFT_PROG,
    TRAIN_DESCRIPTION,
    TRAIN_PROG,
    USER_ERRORS,
    fail,
    parse_args,
    report_unexpected,
)


def _kv(pairs: Sequence[str]) -> dict[str, object]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def cmd_data(args: argparse.Namespace) -> int:
    """Generate a task as verl-format parquet (train and test splits); with --sft, as an SFT set; with
    --preference, as a preference set (the correct answer chosen; a wrong one rejected, sampled from
    --rejected-model or made by rule)."""
    from hybridflow.data.preference import build_preference_task  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)
    from hybridflow.data.sft import build_sft_task  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)
    from hybridflow.data.tasks import build_task  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

    if args.sft and args.preference:
        raise ValueError("--sft and --preference write different sets; give one of them")
    if args.rejected_model and not args.preference:
        raise ValueError("--rejected-model samples the rejected answers of a preference set; add --preference")
    difficulty = _kv(args.difficulty)
    if args.rejected_model:
        from hybridflow.cli.sampled_pairs import wrong_answer_sampler  # noqa: PLC0415  (lazy: loads a model)

        difficulty["sampler"] = wrong_answer_sampler(args.rejected_model, args.samples, args.seed)
    build = build_sft_task if args.sft else build_preference_task if args.preference else build_task
    train, test = build(args.task, args.out, args.train_size, args.test_size, seed=args.seed, **difficulty)
    print(f"wrote {train}\nwrote {test}")
    if args.rejected_model:
        import pandas as pd  # noqa: PLC0415  (lazy: `hybridflow --help` stays light)

        for path in (train, test):
            counts = pd.read_parquet(path, columns=["rejected_source"])["rejected_source"].value_counts()
            print(
                f"{Path(path).name}: rejected answers sampled {counts.get('sampled', 0)}, by rule {counts.get('rule', 0)}"
            )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a full Hugging Face directory (LoRA adapters merged) or, with --adapter, a peft adapter
    directory from a sharded checkpoint."""
    from hybridflow.engine.checkpoint import export_adapter, export_hf  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)
    from hybridflow.train.checkpointing import actor_dir, model_of, tokenizer_of  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

    ckpt = Path(args.ckpt_dir)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist")
    base = args.base_model or model_of(ckpt)
    if args.adapter:
        out = export_adapter(actor_dir(ckpt), args.out, base)
    else:
        out = export_hf(actor_dir(ckpt), args.out, tokenizer_of(ckpt, args.tokenizer), base_model=base)
    print(f"exported {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Sample from a model (or checkpoint) on a parquet file, score and report accuracy."""
    from hybridflow.cli.generate import generate_and_score  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

    metrics = generate_and_score(
        args.model,
        args.data,
        n=args.n,
        out=args.out,
        max_prompt_length=args.max_prompt_length,
        max_response_length=args.max_response_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        batch_size=args.batch_size,
        rollout=args.rollout,
    )
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model over the OpenAI API until interrupted; prints the base URL once it listens."""
    from hybridflow.endpoint.app import AgentServer, ServerConfig, check_bind, start_server  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)
    from hybridflow.endpoint.limits import parse_limits  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)
    from hybridflow.endpoint.rollout_backend import load_rollout_backend  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)
    from hybridflow.models import load_tokenizer, resolve_model_path  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

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


def cmd_tinker(args: argparse.Namespace) -> int:
    """Serve the Tinker API until interrupted; prints the SDK's base_url and model name once it listens."""
    from hybridflow.service.serve import serve_until, start  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

    running = start(args.model, args.host, args.port, args.api_key, args.state_dir, args.max_tokens)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"serving Tinker API at {running.url} base_model={running.service.name}", flush=True)
    serve_until(running, stop)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand except train (which parses its own overrides)."""
    parser = argparse.ArgumentParser(
        prog="hybridflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train (see `hybridflow train --help`)", add_help=False)
    sub.add_parser("sft", help="supervised fine-tuning (see `hybridflow sft --help`)", add_help=False)
    sub.add_parser("dpo", help="preference optimisation, DPO (see `hybridflow dpo --help`)", add_help=False)
    sub.add_parser("plan", help="rank placements from a profile (see `hybridflow plan --help`)", add_help=False)
    sub.add_parser(
        "profile", help="measure operator costs on this machine (see `hybridflow profile --help`)", add_help=False
    )
    d = sub.add_parser("data", help="generate a task as parquet")
    d.add_argument("task")
    d.add_argument("--out", required=True)
    d.add_argument("--sft", action="store_true", help="write an SFT set (prompt/response/messages columns)")
    d.add_argument(
        "--preference",
        action="store_true",
        help="write a preference set (prompt/chosen/rejected columns; the rejected answer is made by rule unless "
        "--rejected-model is given)",
    )
    d.add_argument(
        "--rejected-model",
        help="with --preference: sample the rejected answers from this model (HF directory, 'default' or a "
        "checkpoint): per prompt the first of --samples responses the reward scores 0 (else the rule's)",
    )
    d.add_argument("--samples", type=int, default=4, help="with --rejected-model: responses sampled per prompt")
    d.add_argument("--train-size", type=int, default=2048)
    d.add_argument("--test-size", type=int, default=256)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("difficulty", nargs="*", help="difficulty knobs, e.g. max_operand=20")
    e = sub.add_parser("export", help="checkpoint -> Hugging Face directory")
    e.add_argument("ckpt_dir")
    e.add_argument("--out", required=True)
    e.add_argument("--tokenizer", help="tokenizer directory (default: the run's model)")
    e.add_argument("--base-model", help="LoRA checkpoints: the model the adapters were trained on (default: the run's)")
    e.add_argument("--adapter", action="store_true", help="LoRA checkpoints: write the adapters as a peft directory")
    g = sub.add_parser("generate", help="sample and score on a parquet file")
    g.add_argument("--model", default="default", help="HF directory, 'default', or a checkpoint directory")
    g.add_argument("--data", required=True)
    g.add_argument("--n", type=int, default=1, help="responses per prompt (default 1)")
    g.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature, 0: greedy (default: greedy for --n 1 without --top-p/--top-k, else 1.0)",
    )
    g.add_argument("--top-p", type=float, help="nucleus sampling threshold in (0, 1] (default 1.0: off)")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens (default: all)")
    g.add_argument("--seed", type=int, default=0, help="the sampler's seed: the same seed gives the same samples")
    g.add_argument("--max-prompt-length", type=int, default=128)
    g.add_argument("--max-response-length", type=int, default=64)
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--rollout", choices=ROLLOUT_NAMES, default="native", help="generation backend (rollout.name)")
    g.add_argument("--out", help="write prompts, responses and scores as JSON lines")
    s = sub.add_parser("serve", help="serve a model over the OpenAI API (chat/completions, completions, models)")
    s.add_argument("--model", default="default", help="HF directory or 'default' (the bundled SmolLM2-135M-Instruct)")
    s.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs --api-key")
    s.add_argument("--port", type=int, default=0, help="0: pick a free port (printed)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    s.add_argument("--served-name", help="the model id in /v1/models (default: --model)")
    s.add_argument("--max-tokens", type=int, default=512, help="most new tokens per sample")
    s.add_argument("--dtype", default="fp32", help="rollout dtype: fp32, bf16 or auto")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--on-mismatch", choices=("split", "refuse"), default="split", help="edited history: new trajectory or 400"
    )
    s.add_argument(
        "limits",
        nargs="*",
        help="request limits as key=value, e.g. max_n=4 request_timeout_s=60 (docs/guides/endpoint.md)",
    )

    t = sub.add_parser("tinker", help="serve the Tinker training API to the tinker SDK")
    t.add_argument("--model", default="default", help="HF directory or 'default' (the bundled SmolLM2-135M-Instruct)")
    t.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs --api-key")
    t.add_argument("--port", type=int, default=0, help="0: pick a free port (printed)")
    t.add_argument("--api-key", help="require 'X-API-Key: KEY' on every request (must start with tml-)")
    t.add_argument("--state-dir", help="where checkpoints live (default: hybridflow's cache dir /tinker)")
    t.add_argument("--max-tokens", type=int, default=2048, help="most new tokens per sample")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the subcommand. User errors print one line and exit 2; any other exception (a bug) prints one
    line naming the file that holds its traceback and exits 1; `--debug` (anywhere) prints tracebacks instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    prog = f"hybridflow {argv[0]}" if argv and not argv[0].startswith("-") else "hybridflow"
    try:
        return _dispatch(argv, debug)
    except Exception as err:  # a bug, not a user error: one line and the traceback's file (or --debug)
        return report_unexpected(prog, err, argv, debug)


def _dispatch(argv: list[str], debug: bool) -> int:
    """Run the subcommand `argv[0]` on the rest of `argv`."""
    if argv and argv[0] in ("train", "sft", "dpo"):
        return _run_config_command(argv[0], argv[1:], debug)
    if argv and argv[0] == "profile":
        from hybridflow.cli.profile import main as profile_main  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

        return profile_main(argv[1:])
    if argv and argv[0] == "plan":
        from hybridflow.cli.plan import main as plan_main  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

        try:
            return plan_main(argv[1:])
        except USER_ERRORS as err:
            return fail("hybridflow plan", err, 2, debug)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "data":  # difficulty knobs may come before or after the options
        args.difficulty += [a for a in extra if "=" in a and not a.startswith("-")]
        extra = [a for a in extra if a not in args.difficulty]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler = {
        "data": cmd_data,
        "export": cmd_export,
        "generate": cmd_generate,
        "serve": cmd_serve,
        "tinker": cmd_tinker,
    }[args.command]
    try:
        return handler(args)
    except USER_ERRORS as err:
        return fail(f"hybridflow {args.command}", err, 2, debug)


def _run_config_command(command: str, argv: list[str], debug: bool) -> int:
    """`hybridflow train` / `sft` / `dpo`: `--list-keys` answers without loading the trainer."""
    prog, description = {
        "train": (TRAIN_PROG, TRAIN_DESCRIPTION),
        "sft": (SFT_PROG, SFT_DESCRIPTION),
        "dpo": (DPO_PROG, DPO_DESCRIPTION),
    }[command]
    args = parse_args(argv, prog, description)  # here, so `train --help` needs no torch
    args.debug = args.debug or debug
    if args.list_keys is not None:
        from hybridflow.cli.list_keys import print_keys  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

        return print_keys(command, args.list_keys, prog, args.debug)
    if command == "train":
        from hybridflow.cli.train import train  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

        return train(args)
    if command == "dpo":
        from hybridflow.cli.dpo import dpo  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

        return dpo(args)
    from hybridflow.cli.sft import sft  # noqa: PLC0415  (lazy: a subcommand imports its implementation when it runs)

    return sft(args)


if __name__ == "__main__":
    sys.exit(main())
