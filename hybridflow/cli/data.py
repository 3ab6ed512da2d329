"""`hybridflow data TASK --out DIR [--sft | --preference [--rejected-model M]] ...`: a task as verl-format parquet."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import yaml

from hybridflow.data.preference import build_preference_task
from hybridflow.data.sft import build_sft_task
from hybridflow.data.tasks import build_task


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
