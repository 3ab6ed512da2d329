"""The `hybridflow` command: its parser and dispatch; each subcommand runs from its own module (cli/NAME.py).

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
import sys
from collections.abc import Sequence
from importlib import import_module

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
    module = import_module(f"hybridflow.cli.{args.command}")  # imported only when the subcommand runs
    handler = getattr(module, f"cmd_{args.command}")
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
