"""Layouts left to the planner, chosen from measured inputs: trainer.n_workers_per_node=null (CPU: the
workers x threads split of the node the planner predicts fastest) and trainer.placement=auto (colocate
or split likewise; split for an off-policy trainer.mode, which needs it). Pure: the device profiles and
the machine's size come in `Measurements` (config/measure.py); what was chosen and why comes back as
notes for the log, never printed here.
"""

from __future__ import annotations

from dataclasses import replace

from hybridflow.config.measure import (
    Measurements,
    layout_candidates,
    needs_search,
    no_layout_message,
    threads_per_worker,
)
from hybridflow.config.plan_inputs import run_shape
from hybridflow.config.run import RunConfig
from hybridflow.config.trainer import DEFAULT_WORKERS_PER_NODE
from hybridflow.planner.auto import predicted_placements


def choose_layout(cfg: RunConfig, measured: Measurements) -> tuple[RunConfig, tuple[str, ...]]:
    """`cfg` with trainer.n_workers_per_node and trainer.placement concrete, and one note per choice made."""
    notes: list[str] = []
    if cfg.trainer.n_workers_per_node is None:
        candidates = layout_candidates(cfg, measured.cpu_count, measured.cuda_devices)
        if needs_search(cfg, measured.cpu_count):
            cfg = _fastest_split(candidates, measured, notes)
        else:
            (cfg,) = candidates.values()
    if cfg.trainer.placement == "auto":
        cfg = replace(cfg, trainer=replace(cfg.trainer, placement=_auto_placement(cfg, measured, notes)))
    return cfg, tuple(notes)


SEARCH_TIE = 0.15
"""The layout search keeps the default layout (DEFAULT_WORKERS_PER_NODE workers) unless another is predicted
more than this fraction faster. On the slow-bf16 EPYC (2 cores, SmolLM2 in bf16), where the main job's step
measured 1.08x longer on 1 worker x 2 threads than on 2 x 1, five searches on fresh profiles predicted
0.88-1.06x: differences inside that spread are the profiles' noise and the cost model's error, not the
layouts'."""


def _fastest_split(candidates: dict[int, RunConfig], measured: Measurements, notes: list[str]) -> RunConfig:
    """The candidate (workers per node -> config) with the fastest predicted step at its best placement
    (only the configured placement unless trainer.placement=auto); the default layout where no candidate is
    predicted more than SEARCH_TIE faster than it."""
    cores, placement = measured.cpu_count, next(iter(candidates.values())).trainer.placement
    predicted: dict[int, tuple[float, str]] = {}
    for workers, candidate in candidates.items():
        threads = cores // workers
        times = predicted_placements(run_shape(candidate), threads, measured.profile(threads), measured.model_params)
        if placement != "auto":
            times = {placement: times[placement]} if placement in times else {}
        if times:
            best = min(times, key=times.get)
            predicted[workers] = (times[best], best)
    if not predicted:
        raise ValueError(no_layout_message(cores))
    fastest = min(predicted, key=lambda w: predicted[w][0])
    default = predicted.get(DEFAULT_WORKERS_PER_NODE)
    kept = default is not None and default[0] <= predicted[fastest][0] * (1 + SEARCH_TIE)
    chosen = DEFAULT_WORKERS_PER_NODE if kept else fastest
    splits = ", ".join(f"{w} x {cores // w} threads {s:.1f} ({p})" for w, (s, p) in sorted(predicted.items()))
    why = f"; the default, {fastest} not predicted over {SEARCH_TIE:.0%} faster" if chosen != fastest else ""
    notes.append(f"trainer.n_workers_per_node=null -> {chosen} (predicted s/step: {splits}{why})")
    return candidates[chosen]


def _auto_placement(cfg: RunConfig, measured: Measurements, notes: list[str]) -> str:
    """The placement trainer.placement=auto stands for: split off-policy, else the fastest predicted."""
    t = cfg.trainer
    if t.mode != "sync":
        return "split"
    threads = threads_per_worker(t, measured.cpu_count, t.n_workers_per_node)
    predicted = predicted_placements(run_shape(cfg), threads, measured.profile(threads), measured.model_params)
    chosen = min(predicted, key=predicted.get)
    times = ", ".join(f"{p} {s:.1f}" for p, s in predicted.items())
    notes.append(f"trainer.placement=auto -> {chosen} (predicted s/step: {times})")
    return chosen
