"""Judge plugins for tests/test_judge.py, named by `file.py:function` path in the config (so the Ray workers load
them too): a parser for the tiny random judge's fixed verdict, a template that raises on a marked row, and judge
rollout backends that fail or stall."""

from __future__ import annotations

import time

from hybridflow.rewards.judge import reference_yes_no
from hybridflow.rollout import ROLLOUT_BACKENDS

STALL_S = 30.0
"""How long the stalling backend's generate sleeps (tests set judge.timeout_s well below it)."""


def newline_parser(verdict: str) -> float | None:
    """The tiny random judge's greedy verdict is newlines only: a tenth of their count; None for anything else."""
    if not verdict or verdict.strip():
        return None
    return verdict.count("\n") / 10


def raising_template(question: str, response: str, ground_truth: str, extra_info=None) -> str:
    """The built-in template, except that a question holding RAISE raises."""
    if "RAISE" in question:
        raise RuntimeError("this row's template fails")
    return reference_yes_no(question, response, ground_truth, extra_info)


def failing_rollout(config, model, tokenizer, tp_stride):
    """The native rollout, whose generate raises."""
    rollout = ROLLOUT_BACKENDS.get("native").build(config, model, tokenizer, tp_stride)

    def fail(prompts, sampling=None):
        raise RuntimeError("judge backend down")

    rollout.generate_sequences = fail
    return rollout


def stalling_rollout(config, model, tokenizer, tp_stride):
    """The native rollout, whose generate first sleeps STALL_S seconds."""
    rollout = ROLLOUT_BACKENDS.get("native").build(config, model, tokenizer, tp_stride)
    generate = rollout.generate_sequences

    def stall(prompts, sampling=None):
        time.sleep(STALL_S)
        return generate(prompts, sampling)

    rollout.generate_sequences = stall
    return rollout
