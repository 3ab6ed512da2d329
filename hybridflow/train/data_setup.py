"""Prompts for a run: the configured parquet files, or a task generated once into a cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from hybridflow.config.data import DataConfig, TaskFilesConfig
from hybridflow.data.dataset import RLDataset, collate
from hybridflow.data.loader import StatefulDataLoader
from hybridflow.data.preference import build_preference_task
from hybridflow.data.sft import build_sft_task
from hybridflow.data.tasks import build_task
from hybridflow.rewards.registry import SCORERS
from hybridflow.utils.atomic import atomic_dir


def task_files(cfg: TaskFilesConfig, sft: bool = False, preference: bool = False) -> tuple[list[str], list[str]]:
    """(train files, val files): as configured, or generated from data.task (cached, written atomically);
    with `sft`, the task's SFT set (hybridflow/data/sft.py) instead of its prompts, with `preference` its
    preference set (hybridflow/data/preference.py)."""
    if cfg.train_files:
        return list(cfg.train_files), list(cfg.val_files or cfg.train_files)

    spec = {"task": cfg.task, "kw": cfg.task_kwargs, "n": [cfg.gen_train_size, cfg.gen_val_size], "seed": cfg.seed}
    spec.update({"sft": True} if sft else {})  # RL sets keep the cache names they always had
    spec.update({"preference": True} if preference else {})
    tag = hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:10]
    out = Path(cfg.task_dir).expanduser() / f"{cfg.task}-{tag}"
    build, prefix = (build_sft_task, f"{cfg.task}_sft") if sft else (build_task, cfg.task)
    if preference:
        build, prefix = build_preference_task, f"{cfg.task}_preference"
    if not out.exists():
        with atomic_dir(out, replace=False) as tmp:  # another process that finished first keeps its files
            build(cfg.task, tmp, cfg.gen_train_size, cfg.gen_val_size, seed=cfg.seed, **cfg.task_kwargs)
    train, test = out / f"{prefix}_train.parquet", out / f"{prefix}_test.parquet"
    return [str(train)], list(cfg.val_files) or [str(test)]


def make_loaders(cfg: DataConfig, tokenizer: Any) -> tuple[StatefulDataLoader, StatefulDataLoader]:
    """Seeded, resumable train loader and an in-order validation loader, both yielding DataProto."""
    train_files, val_files = task_files(cfg)
    kw = dict(
        max_prompt_length=cfg.max_prompt_length,
        filter_overlong_prompts=cfg.filter_overlong_prompts,
        truncation=cfg.truncation,
    )
    train = RLDataset(train_files, tokenizer, **kw)
    val = RLDataset(val_files, tokenizer, **kw)
    train_loader = StatefulDataLoader(
        train, cfg.train_batch_size, seed=cfg.seed, shuffle=cfg.shuffle, collate_fn=collate
    )
    val_bs = min(cfg.val_batch_size or len(val), len(val))
    val_loader = StatefulDataLoader(val, val_bs, shuffle=False, collate_fn=collate, drop_last=False)
    return train_loader, val_loader


def check_data_sources(*datasets: RLDataset) -> None:
    """Every row's data_source has a rule scorer: a row no scorer handles fails here, naming its file and row,
    rather than when it is first scored. Call it when the rows are scored by the rule scorers (no
    reward.custom_reward_function, and single-turn or the built-in "tool" environment)."""
    for dataset in datasets:
        for row in dataset.rows:
            if row["data_source"] not in SCORERS:
                raise ValueError(
                    f"{row['_file']}: row {row['_row']}: column 'data_source' is {row['data_source']!r}, which no "
                    f"rule scorer handles (known: {', '.join(SCORERS.names())}); register one with "
                    "hybridflow.rewards.register_scorer (trainer.plugins), or set reward.custom_reward_function.path"
                )
