"""Answer extraction and number comparison shared by the rule scorers."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number ("1,234", "-3", "2.50", "3/4"); None if it is not one."""
    text = text.strip().replace(",", "").rstrip(".").replace(" ", "")
    if text.count("/") == 1:
        num, den = (parse_number(part) for part in text.split("/"))
        return None if num is None or den is None or den == 0 else num / den
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def after_hashes(solution: str) -> str | None:
    """The number written after the last `####`, or None when there is none."""
    matches = _HASHES_RE.findall(solution)
    return matches[-1] if matches else None


def last_number(solution: str) -> str | None:
    """The last number anywhere in `solution`, or None."""
    matches = _NUMBER_RE.findall(solution)
    return matches[-1] if matches else None


def same_number(answer: str | None, ground_truth: str) -> bool:
    """True when `answer` and `ground_truth` parse to the same exact number."""
    if answer is None:
        return False
    got, want = parse_number(answer), parse_number(ground_truth)
    return got is not None and got == want
