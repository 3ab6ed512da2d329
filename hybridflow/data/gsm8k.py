"""GSM8K-style task: templated multi-step word problems, answer after `####`.

Each template is a short story with two to four quantities and a worked
solution in GSM8K's format (steps, then `#### <answer>`), stored in
`extra_info["answer"]`. Quantities are drawn so that every intermediate
result is a non-negative integer. `GSM8KDifficulty.max_value` scales them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridflow.data.tasks import Problem, register_task

INSTRUCTION = 'Think step by step, then write the final answer as a number after "####".'
"""Answer-format instruction appended to every question."""

_NAMES = ("Ava", "Ben", "Carla", "Dev", "Emma", "Finn", "Grace", "Hugo", "Ines", "Jamal")


@dataclass
class GSM8KDifficulty:
    """Difficulty knobs of the GSM8K-style task."""

    max_value: int = 20
    """Largest base quantity in a story (>= 3); products of two such values appear."""

    def __post_init__(self) -> None:
        if self.max_value < 3:
            raise ValueError(f"max_value must be >= 3, got {self.max_value}")


Story = tuple[str, str, int]  # question, worked solution, answer


def _apples(rng: np.random.Generator, m: int, name: str) -> Story:
    a, b, c = (int(rng.integers(2, m + 1)) for _ in range(3))
    d = int(rng.integers(1, a + b * c + 1))
    total = a + b * c
    question = (
        f"{name} has {a} apples. {name} buys {b} bags with {c} apples in each bag, "
        f"then gives {d} apples to a friend. How many apples does {name} have now?"
    )
    steps = f"The bags hold {b} * {c} = {b * c} apples. {a} + {b * c} = {total}. {total} - {d} = {total - d}."
    return question, steps, total - d


def _change(rng: np.random.Generator, m: int, name: str) -> Story:
    price, count = int(rng.integers(1, m + 1)), int(rng.integers(2, 10))
    cost = price * count
    bill = next(b for b in (5, 10, 20, 50, 100, 200, 500, 1000, 10**6) if b >= cost)
    question = (
        f"A notebook costs ${price}. {name} buys {count} notebooks and pays with a "
        f"${bill} bill. How many dollars of change does {name} get?"
    )
    steps = f"The notebooks cost {count} * {price} = {cost} dollars. {bill} - {cost} = {bill - cost}."
    return question, steps, bill - cost


def _pages(rng: np.random.Generator, m: int, name: str) -> Story:
    a, d, b, e = (int(rng.integers(2, m + 1)) for _ in range(4))
    question = (
        f"{name} reads {a} pages a day for {d} days, then {b} pages a day for {e} days. "
        f"How many pages does {name} read in total?"
    )
    steps = f"First {a} * {d} = {a * d} pages, then {b} * {e} = {b * e} pages. {a * d} + {b * e} = {a * d + b * e}."
    return question, steps, a * d + b * e


def _legs(rng: np.random.Generator, m: int, name: str) -> Story:
    cows, hens = int(rng.integers(1, m + 1)), int(rng.integers(1, m + 1))
    question = f"{name}'s farm has {cows} cows and {hens} chickens. How many legs do the animals have altogether?"
    steps = f"Cows have {cows} * 4 = {4 * cows} legs, chickens {hens} * 2 = {2 * hens}. {4 * cows} + {2 * hens} = {4 * cows + 2 * hens}."
    return question, steps, 4 * cows + 2 * hens


def _wages(rng: np.random.Generator, m: int, name: str) -> Story:
    wage, hours, days = int(rng.integers(5, m + 6)), int(rng.integers(2, 9)), int(rng.integers(2, 6))
    earned = wage * hours * days
    spent = int(rng.integers(1, earned + 1))
    question = (
        f"{name} earns ${wage} an hour and works {hours} hours a day for {days} days. "
        f"{name} then spends ${spent}. How many dollars does {name} have left?"
    )
    steps = (
        f"A day pays {wage} * {hours} = {wage * hours}. {days} days pay {wage * hours} * {days} = {earned}. "
        f"{earned} - {spent} = {earned - spent}."
    )
    return question, steps, earned - spent


def _share(rng: np.random.Generator, m: int, name: str) -> Story:
    friends, each, extra = int(rng.integers(2, 7)), int(rng.integers(2, m + 1)), int(rng.integers(0, 6))
    total = friends * each + extra
    question = (
        f"{name} has {total} stickers and shares them equally among {friends} friends, "
        f"keeping the {extra} that are left over. How many stickers does each friend get?"
    )
    steps = f"{total} - {extra} = {friends * each} are shared. {friends * each} / {friends} = {each}."
    return question, steps, each


TEMPLATES: tuple[Callable[[np.random.Generator, int, str], Story], ...] = (
    _apples,
    _change,
    _pages,
    _legs,
    _wages,
    _share,
)


@register_task("gsm8k", GSM8KDifficulty)
def make_gsm8k(rng: np.random.Generator, level: GSM8KDifficulty) -> Problem:
    """One word problem; `extra_info["answer"]` holds the worked solution ending in `#### N`."""
    template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    name = _NAMES[int(rng.integers(len(_NAMES)))]
    question, steps, answer = template(rng, level.max_value, name)
    extra = {"question": question, "answer": f"{steps}\n#### {answer}", "template": template.__name__[1:]}
    return Problem(f"{question} {INSTRUCTION}", str(answer), extra)
