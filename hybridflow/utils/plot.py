"""Read a run's `metrics.jsonl` back: a 3-panel PNG and a short text summary.

Which keys are used:
- reward: `critic/score/mean` (the task score before any KL penalty); an SFT run, which has
  none, shows `train/loss` in that panel instead (and `train/tokens_per_s` instead of the
  response length);
- validation: every key starting with "val-core/" or "val/" (e.g.
  `val-core/arithmetic/acc/mean@1`), one line each; "val-aux/" keys are not plotted;
- response length: `response_length/mean`;
- time (summary only): the sum of `timing_s/step`.
A panel without data says "no data". A step logged twice (a resumed run
appends to the file) counts once, its records merged with later values winning.

Plots use matplotlib's object API with the Agg canvas, so importing this
module never changes the global pyplot backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from hybridflow.utils.tracking import VAL_PREFIXES

REWARD_KEY = "critic/score/mean"
LENGTH_KEY = "response_length/mean"
STEP_TIME_KEY = "timing_s/step"
TRAIN_LOSS_KEY = "train/loss"
TOKENS_PER_S_KEY = "train/tokens_per_s"
REWARD_PANEL = ([REWARD_KEY], "reward", "score")
LENGTH_PANEL = ([LENGTH_KEY], "response length", "tokens")
SFT_PANELS = {
    REWARD_KEY: ([TRAIN_LOSS_KEY], "train loss", "loss"),
    LENGTH_KEY: ([TOKENS_PER_S_KEY], "throughput", "tokens/s"),
}
"""What an SFT run (no reward, no generated responses) shows in the RL run's panels."""


def read_metrics(jsonl_path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, one per step, sorted by step.

    Records of a repeated step (validation logged separately, or a resumed run
    appending) are merged; on a clash the later value wins.
    """
    path = Path(jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}; run with trainer.logger including 'jsonl'")
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise ValueError(f"{path}:{line_no} is not valid JSON") from None
                continue  # a last line cut short by a crash
            by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping steps where it is missing or null."""
    points = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def val_keys(records: list[dict[str, Any]]) -> list[str]:
    """Every validation key (prefix in VAL_PREFIXES) present in any record, sorted."""
    return sorted({k for r in records for k in r if k.startswith(VAL_PREFIXES)})


def run_figure(records: list[dict[str, Any]], title: str = "") -> Figure:
    """The 3-panel figure (reward, validation, response length over steps) of `read_metrics` records."""
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    reward_ax, val_ax, length_ax = fig.subplots(1, 3)
    _panel(reward_ax, records, *_pick(records, REWARD_PANEL))
    _panel(val_ax, records, val_keys(records), "validation", "value")
    _panel(length_ax, records, *_pick(records, LENGTH_PANEL))
    fig.suptitle(title)
    return fig


def plot_run(jsonl_path: str | Path, out_png: str | Path) -> Path:
    """Write a PNG with reward, validation and response-length panels over steps; return its path."""
    fig = run_figure(read_metrics(jsonl_path), title=Path(jsonl_path).parent.name)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def summarize_run(jsonl_path: str | Path) -> str:
    """A few lines: steps logged, reward and validation first -> last, response length, total time."""
    records = read_metrics(jsonl_path)
    if not records:
        return f"{jsonl_path}: no metrics logged"
    steps = [r["step"] for r in records]
    lines = [f"{jsonl_path}: {len(records)} steps logged (steps {steps[0]}..{steps[-1]})"]
    (key,), label, _ = _pick(records, REWARD_PANEL)
    lines.append(_first_last(records, key, label))
    lines.extend(_first_last(records, key, "val") for key in val_keys(records) or ["val-core/*"])
    (key,), label, _ = _pick(records, LENGTH_PANEL)
    lines.append(_first_last(records, key, label))
    _, times = series(records, STEP_TIME_KEY)
    if times:
        lines.append(f"time: {sum(times):.1f} s total over {len(times)} steps ({sum(times) / len(times):.2f} s/step)")
    else:
        lines.append(f"time: no data ({STEP_TIME_KEY})")
    return "\n".join(lines)


def _pick(records: list[dict[str, Any]], panel: tuple[list[str], str, str]) -> tuple[list[str], str, str]:
    """`panel` (keys, title, y label), or its SFT_PANELS stand-in for a run that logged only that one."""
    sft = SFT_PANELS[panel[0][0]]
    if series(records, panel[0][0])[0] or not series(records, sft[0][0])[0]:
        return panel
    return sft


def _panel(ax: Axes, records: list[dict[str, Any]], keys: list[str], title: str, ylabel: str) -> None:
    """One line per key that has data; 'no data' in the middle otherwise."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    drawn = 0
    for key in keys:
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14, color="gray")
    else:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _first_last(records: list[dict[str, Any]], key: str, label: str) -> str:
    """`label (key): first at step a -> last at step b`, or `no data`."""
    steps, values = series(records, key)
    if not steps:
        return f"{label} ({key}): no data"
    return f"{label} ({key}): {values[0]:.4g} at step {steps[0]} -> {values[-1]:.4g} at step {steps[-1]}"
