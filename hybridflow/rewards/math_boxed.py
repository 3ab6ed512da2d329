"""Scorer for MATH-style answers written as `\\boxed{...}`.

The last `\\boxed{...}` (or `\\fbox{...}`) of the response is compared with
the ground truth (which may itself be boxed) after normalising simple forms:
spaces, `$`, `\\left`/`\\right`, `\\!`, `\\text{...}` wrappers, degree and
percent signs, `\\dfrac`/`\\tfrac`, `\\frac{a}{b}` and `\\frac ab` written as
`a/b`, a leading `x =`, a trailing period. Two answers that both parse as
numbers (including `a/b`) compare by exact value, so `0.5`, `1/2` and
`\\frac{1}{2}` agree. Anything beyond that (symbolic equivalence, units,
intervals in other orders) compares as normalised strings.
"""

from __future__ import annotations

import re

from hybridflow.rewards.extract import parse_number

_FRAC_BRACED = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$", "^{\\circ}", "^\\circ", "\\%", "%", " ")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def normalize(answer: str) -> str:
    """`answer` in a canonical string form for comparison."""
    answer = answer.strip()
    answer = _TEXT.sub(r"\1", answer)
    for token in _REMOVE:
        answer = answer.replace(token, "")
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    answer = _FRAC_BRACED.sub(r"\1/\2", answer)
    answer = _FRAC_SHORT.sub(r"\1/\2", answer)
    answer = re.sub(r"^[a-zA-Z]=", "", answer)
    return answer.rstrip(".")


def is_equiv(answer: str, ground_truth: str) -> bool:
    """True when the two answers agree after normalisation (numerically when both are numbers)."""
    a, b = normalize(answer), normalize(ground_truth)
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return na == nb
    return a == b


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer matches `ground_truth`, else 0.0 (also when nothing is boxed)."""
    answer = last_boxed(solution_str)
    truth = last_boxed(ground_truth) or ground_truth
    return 1.0 if answer is not None and is_equiv(answer, truth) else 0.0
