"""docs/verl_runtime.md cannot rot: its verl-style program runs on the tests' local Ray."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "verl_runtime.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def test_the_verl_program_runs_with_only_its_imports_changed(ray_local):
    assert len(BLOCKS) == 1
    exec(compile(BLOCKS[0], f"{PAGE}:block0", "exec"), {"__name__": "docs_verl_runtime"})
