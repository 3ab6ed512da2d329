"""A judge model's prompt templates and verdict parsers (judge.template, judge.parser), each a registry of plugins.

A template turns one scored row into the judge's prompt:

    template(question: str, response: str, ground_truth: str, extra_info: dict | None) -> str | list[dict]

`question` is the last user message of the row's chat prompt, `response` the policy's decoded response. A string
is sent as one user message; a list of chat messages as given. The judge's own chat template is applied to either.

A parser turns the judge's decoded verdict into a score:

    parser(verdict: str) -> float | None

None means the verdict could not be read: the row is counted in judge/invalid and scored judge.invalid_score.

Register one with `JUDGE_TEMPLATES.register(name, fn)` / `JUDGE_PARSERS.register(name, fn)` in a trainer.plugins
module, or name it by `module:function` (or `file.py:function`) path in the config. Both run in the judge's worker
process. verl puts the template and the parser inside a custom reward function that calls its reward router; here
they are two plugins and the judge is called once per step for the whole batch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from hybridflow.utils.registry import Registry

JudgeTemplate = Callable[[str, str, str, Any], "str | list[dict[str, str]]"]
"""(question, response, ground_truth, extra_info) -> the judge's prompt: a user message, or chat messages."""
JudgeParser = Callable[[str], "float | None"]
"""verdict -> score, or None when the verdict is unreadable."""

_HINT = "register one in a trainer.plugins module or give a module:function path"
JUDGE_TEMPLATES: Registry[JudgeTemplate] = Registry("judge prompt template", "judge.template", _HINT)
"""Judge prompt templates by name."""
JUDGE_PARSERS: Registry[JudgeParser] = Registry("judge verdict parser", "judge.parser", _HINT)
"""Judge verdict parsers by name."""


@JUDGE_TEMPLATES.register("reference_yes_no")
def reference_yes_no(question: str, response: str, ground_truth: str, extra_info: Any = None) -> str:
    """Asks whether the response's final answer matches the reference answer; answer yes or no."""
    return (
        f"Problem: {question}\n"
        f"Reference answer: {ground_truth}\n"
        f"Student answer: {response}\n"
        "Does the student's final answer equal the reference answer? Reply with one word: yes or no."
    )


@JUDGE_TEMPLATES.register("yes_no")
def yes_no(question: str, response: str, ground_truth: str, extra_info: Any = None) -> str:
    """Asks whether the response is correct, without the reference answer; answer yes or no."""
    return (
        f"Problem: {question}\n"
        f"Student answer: {response}\n"
        "Is the student's final answer correct? Reply with one word: yes or no."
    )


_WORD = re.compile(r"[a-z]+")
_INTEGER = re.compile(r"-?\d+")


@JUDGE_PARSERS.register("yes_no")
def parse_yes_no(verdict: str) -> float | None:
    """1.0 when the verdict's first word is "yes", 0.0 when it is "no"; None otherwise."""
    word = _WORD.search(verdict.lower())
    if word is None or word.group() not in ("yes", "no"):
        return None
    return 1.0 if word.group() == "yes" else 0.0


@JUDGE_PARSERS.register("score_0_10")
def parse_score_0_10(verdict: str) -> float | None:
    """The verdict's first integer, when it is in 0..10, divided by 10; None otherwise."""
    number = _INTEGER.search(verdict)
    if number is None or not 0 <= int(number.group()) <= 10:
        return None
    return int(number.group()) / 10


def question_of(raw_prompt: Any) -> str:
    """The last user message of a chat prompt (a list of {role, content}); a plain string as is."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    users = [m["content"] for m in raw_prompt if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def as_messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    """A template's output as chat messages (a string is one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        return prompt
    raise TypeError(
        f"a judge.template must return a string or a list of {{role, content}} messages, got {type(prompt).__name__}"
    )
