"""Do two runs log the same metrics? Compares two metrics.jsonl files step by step, key by key.

    python bench/same_metrics.py outputs/a/metrics.jsonl outputs/b/metrics.jsonl

For a refactor that must not change a run: run the same command (fixed seed, same machine) before
and after, then compare. Measured quantities that differ between any two runs (wall times, memory,
throughput) are left out; every other value must be exactly equal. Exit 0 when equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MEASURED = (
    "timing_s/",
    "memory/",
    "fault/recovery_s",
    "perf/gen_tokens_per_s",
    "perf/throughput",
    "perf/time_per_step",
    "train/tokens_per_s",
)
"""Key prefixes of measured quantities: never equal between two runs, so not compared."""


def records(path: Path) -> dict[int, dict]:
    """step -> the metrics logged for it (a redone step's last record wins)."""
    steps: dict[int, dict] = {}
    for line in filter(None, path.read_text().splitlines()):
        record = json.loads(line)
        steps[record["step"]] = record
    return steps


def differences(a: dict[int, dict], b: dict[int, dict]) -> list[str]:
    """Every step, key or value that differs between two runs' records (measured keys left out)."""
    if sorted(a) != sorted(b):
        return [f"steps differ: {sorted(a)} vs {sorted(b)}"]
    out = []
    for step in sorted(a):
        keys = {k for k in a[step].keys() | b[step].keys() if not k.startswith(MEASURED)}
        for key in sorted(keys):
            x, y = a[step].get(key, "<missing>"), b[step].get(key, "<missing>")
            if x != y:
                out.append(f"step {step} {key}: {x} vs {y}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    a, b = records(args.a), records(args.b)
    diff = differences(a, b)
    compared = sum(len([k for k in r if not k.startswith(MEASURED)]) for r in a.values())
    for line in diff:
        print(line)
    print(f"{len(a)} steps, {compared} values compared: {'identical' if not diff else f'{len(diff)} differ'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
