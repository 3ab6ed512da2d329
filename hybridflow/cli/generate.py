"""`hybridflow generate`: sample from a model or a checkpoint on a verl-format parquet and score it.

Runs in this process (no workers): load the model into a rollout, generate for every
prompt, score with the rule scorers by data_source, report mean@n / pass@n per source
and optionally write every prompt, response and score as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.data.dataset import RLDataset, collate
from hybridflow.engine.checkpoint import export_hf
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.protocol import keys as K
from hybridflow.rewards import RewardManager
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.train.checkpointing import actor_dir, model_of, tokenizer_of
from hybridflow.train.validation import summarize_scores


def model_dir(model: str, tmp: Path) -> Path:
    """An HF directory for `model`: as given, "default", or exported from a trainer checkpoint."""

    path = Path(model)
    if (path / "actor").is_dir() or (path / ".metadata").exists():
        # A LoRA checkpoint is merged into the run's model (full checkpoints ignore base_model).
        return Path(export_hf(actor_dir(path), tmp / "hf", tokenizer_of(path, None), base_model=model_of(path)))
    return Path(resolve_model_path(model))


def sampling_settings(
    n: int, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None
) -> dict[str, Any]:
    """RolloutConfig's sampling fields for `hybridflow generate`: greedy decoding for temperature 0, or for n == 1
    when no temperature, top_p or top_k is given; otherwise sampling with the given values (unset: temperature 1.0,
    top_p 1.0, top_k -1). A flag that greedy decoding would ignore is refused (ValueError)."""
    if temperature == 0:
        given = (("--n", n != 1), ("--top-p", top_p is not None), ("--top-k", top_k is not None))
        ignored = [flag for flag, is_given in given if is_given]
        if ignored:
            raise ValueError(f"--temperature 0 decodes greedily (one response per prompt), which ignores {ignored}")
    sample = temperature != 0 and (n > 1 or any(v is not None for v in (temperature, top_p, top_k)))
    return {
        "n": n,
        "do_sample": sample,
        "temperature": 1.0 if temperature in (None, 0) else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": -1 if top_k is None else top_k,
    }


def generate_and_score(
    model: str,
    data: str,
    n: int = 1,
    out: str | None = None,
    max_prompt_length: int = 128,
    max_response_length: int = 64,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
    rollout: str = "native",
) -> dict[str, float]:
    """Generate n responses per prompt with the `rollout` backend, sampling as `sampling_settings` says, score them,
    return metrics."""

    sampling = sampling_settings(n, temperature, top_p, top_k)  # before loading the model: a bad flag fails fast
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(model, Path(tmp))
        tokenizer = load_tokenizer(path)
        cfg = RolloutConfig(
            name=rollout,
            seed=seed,
            prompt_length=max_prompt_length,
            response_length=max_response_length,
            **sampling,
        )
        engine = build_rollout(cfg, path, tokenizer)
    dataset = RLDataset(data, tokenizer, max_prompt_length)
    reward = RewardManager(tokenizer)
    rows, sources, uids, scores = [], [], [], []
    for start in range(0, len(dataset), batch_size):
        prompts = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        prompts.non_tensor_batch[K.UID] = np.arange(start, start + len(prompts)).astype(str).astype(object)
        result = engine.generate_sequences(prompts)
        scored = reward(result)
        texts = tokenizer.batch_decode(result.batch[K.RESPONSES], skip_special_tokens=True)
        sources += [str(s) for s in result.non_tensor_batch[K.DATA_SOURCE]]
        uids += list(result.non_tensor_batch[K.UID])
        scores += scored.scores
        rows += [
            {"uid": u, "prompt": p, "response": t, "score": s}
            for u, p, t, s in zip(
                result.non_tensor_batch[K.UID], result.non_tensor_batch[K.RAW_PROMPT], texts, scored.scores
            )
        ]
    if out:
        Path(out).write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    return summarize_scores(sources, uids, scores, n, prefix="gen")


def cmd_generate(args: argparse.Namespace) -> int:
    """Sample from a model (or checkpoint) on a parquet file, score and report accuracy."""
    metrics = generate_and_score(
        args.model,
        args.data,
        n=args.n,
        out=args.out,
        max_prompt_length=args.max_prompt_length,
        max_response_length=args.max_response_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        batch_size=args.batch_size,
        rollout=args.rollout,
    )
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    return 0
