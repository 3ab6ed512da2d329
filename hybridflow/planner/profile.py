"""Run profile: where a step's time goes, per role and operator, from the metrics a run already logs.

`build_profile(rows)` reads the per-step rows of metrics.jsonl (the `timing_s/*` and `perf/*`
metrics of PPOTrainer.train_step and the workers) and returns one `OperatorProfile` per operator
seen; `write_profile(log_dir)` writes them as profile.md (for a reader) and profile.json (for the
cost model). Operators the run did not time (e.g. no critic) are left out, not shown as zero.

What today's metrics can tell apart: old log-probs, ref log-probs and values are issued together
and timed as one phase (`timing_s/old_log_prob_ref_values`), so they are one row here; the
worker-side `*_on_worker` timings separate the actor and critic updates. Peak memory per operator
comes from the workers' `memory/peak_gb/<operator>` metrics (utils/peak_memory.py: RSS high-water on
CPU, the CUDA allocator's peak on GPU; the largest over the workers of a call, and over the steps);
each row shows the peaks of the operators it times, the step row every `memory/*` metric.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OPERATORS: tuple[tuple[str, str, str, str], ...] = (
    # (role, operator, timing metric, tokens the operator processes: "response" or "all")
    ("actor_rollout", "weight sync", "timing_s/weight_sync", ""),
    ("actor_rollout", "generate", "timing_s/gen", "response"),
    ("actor_rollout", "generate (on worker)", "timing_s/generate_on_worker", "response"),
    ("reward", "reward", "timing_s/reward", "all"),
    ("judge", "judge verdicts (within reward)", "timing_s/judge", "all"),
    ("actor_rollout+ref+critic", "old log-probs, ref log-probs, values", "timing_s/old_log_prob_ref_values", "all"),
    ("controller", "advantages", "timing_s/adv", ""),
    ("actor_rollout+critic", "update (actor and critic)", "timing_s/update", "all"),
    ("actor_rollout", "update actor (on worker)", "timing_s/update_actor_on_worker", "all"),
    ("critic", "update critic (on worker)", "timing_s/update_critic_on_worker", "all"),
    ("all", "step", "timing_s/step", "all"),
)
"""Every operator the profile reports, in dataflow order."""

MEMORY_OPS = {
    "timing_s/gen": ("generate",),
    "timing_s/generate_on_worker": ("generate",),
    "timing_s/old_log_prob_ref_values": ("old_log_prob", "ref_log_prob", "values"),
    "timing_s/update": ("update_actor", "update_critic"),
    "timing_s/update_actor_on_worker": ("update_actor",),
    "timing_s/update_critic_on_worker": ("update_critic",),
}
"""Timing metric -> the operators (memory/peak_gb/<operator>) whose peak memory its row shows."""


@dataclass
class OperatorProfile:
    """Time and tokens of one operator over the steps of a run."""

    role: str
    """The role(s) the operator runs on ("actor_rollout", "critic", "controller", ...)."""
    operator: str
    """What it does, in words."""
    metric: str
    """The metrics.jsonl key its seconds come from."""
    steps: int
    """Steps on which it ran."""
    median_s: float
    """Median seconds per step on which it ran."""
    total_s: float
    """Seconds summed over the run."""
    tokens_per_step: float
    """Median tokens it processed per step (0 when not token-bound, e.g. weight sync)."""
    tokens_per_s: float
    """tokens_per_step / median_s (0 when either is 0)."""
    peak_memory: dict[str, float] = field(default_factory=dict)
    """Largest value over the run of each memory/* metric of this operator (every one for the step row)."""


def _tokens(row: dict[str, Any], kind: str) -> float:
    if kind == "all":
        return float(row.get("perf/total_num_tokens", 0.0))
    if kind == "response" and "perf/gen_tokens_per_s" in row and "timing_s/gen" in row:
        return float(row["perf/gen_tokens_per_s"]) * float(row["timing_s/gen"])
    return 0.0


def build_profile(rows: Sequence[dict[str, Any]]) -> list[OperatorProfile]:
    """One OperatorProfile per operator timed in `rows` (metrics.jsonl records); training steps only."""
    steps = [r for r in rows if "timing_s/step" in r]
    memory = {}
    for row in steps:
        for key, value in row.items():
            if key.startswith("memory/"):
                memory[key] = max(memory.get(key, float("-inf")), float(value))
    out = []
    for role, operator, metric, kind in OPERATORS:
        ran = [r for r in steps if metric in r]
        if not ran:
            continue
        seconds = [float(r[metric]) for r in ran]
        median_s = statistics.median(seconds)
        tokens = statistics.median(_tokens(r, kind) for r in ran)
        out.append(
            OperatorProfile(
                role,
                operator,
                metric,
                len(ran),
                median_s,
                sum(seconds),
                tokens,
                tokens / median_s if tokens and median_s > 0 else 0.0,
                _row_memory(memory, metric),
            )
        )
    return out


def _row_memory(memory: dict[str, float], metric: str) -> dict[str, float]:
    if metric == "timing_s/step":
        return dict(memory)
    ops = MEMORY_OPS.get(metric, ())
    return {k: v for k, v in memory.items() if k.startswith("memory/peak_gb/") and k.rsplit("/", 1)[1] in ops}


def to_markdown(profile: Sequence[OperatorProfile]) -> str:
    """The profile as a Markdown table (profile.md)."""
    lines = [
        "| role | operator | steps | median s | total s | tokens/step | tokens/s | peak GB/worker |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in profile:
        peaks = [v for k, v in p.peak_memory.items() if k.startswith("memory/peak_gb/")]
        peak = f"{max(peaks):.2f}" if peaks else "-"
        lines.append(
            f"| {p.role} | {p.operator} | {p.steps} | {p.median_s:.3f} | {p.total_s:.2f} "
            f"| {p.tokens_per_step:.0f} | {p.tokens_per_s:.1f} | {peak} |"
        )
    memory = next((p.peak_memory for p in profile if p.metric == "timing_s/step"), {})
    lines.append("")
    lines.append(
        "peak memory: "
        + (", ".join(f"{k} {v:.4g}" for k, v in sorted(memory.items())) if memory else "not recorded by this run")
    )
    return "\n".join(lines) + "\n"


def write_profile(log_dir: Path) -> Path | None:
    """Write profile.md and profile.json next to log_dir/metrics.jsonl; None when there is nothing to profile."""
    metrics_file = log_dir / "metrics.jsonl"
    if not metrics_file.exists():
        return None
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    profile = build_profile(rows)
    if not profile:
        return None
    (log_dir / "profile.json").write_text(json.dumps([asdict(p) for p in profile], indent=1) + "\n")
    path = log_dir / "profile.md"
    path.write_text(to_markdown(profile))
    return path
