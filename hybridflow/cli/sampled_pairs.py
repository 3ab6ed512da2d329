"""Wrong answers sampled from a model, for `hybridflow data TASK --preference --rejected-model MODEL`.

`wrong_answer_sampler` returns a `WrongAnswerSampler` (hybridflow/data/preference.py): it writes the rows to a
temporary verl parquet, samples `n` responses per prompt at temperature 1 with `hybridflow generate`'s machinery
(in this process, the native rollout), scores them with the task's rule reward, and gives each row its first
non-empty response that scored 0 (None where all `n` were right: the builder falls back to its rule).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from hybridflow.cli.generate import generate_and_score
from hybridflow.data.preference import WrongAnswerSampler

logger = logging.getLogger(__name__)


def wrong_answer_sampler(
    model: str, n: int = 4, seed: int = 0, max_response_length: int = 64, batch_size: int = 64
) -> WrongAnswerSampler:
    """A sampler of wrong answers from `model` (an HF directory, "default" or a checkpoint); see module docstring."""
    if n < 1:
        raise ValueError(f"--samples must be >= 1, got {n}")

    def sample(rows: list[dict[str, Any]]) -> list[str | None]:
        with tempfile.TemporaryDirectory() as tmp:
            data, out = Path(tmp) / "prompts.parquet", Path(tmp) / "samples.jsonl"
            pd.DataFrame(rows).to_parquet(data, index=False)
            generate_and_score(
                model,
                str(data),
                n=n,
                out=str(out),
                temperature=1.0,
                seed=seed,
                max_response_length=max_response_length,
                batch_size=batch_size,
            )
            samples = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        wrong: list[str | None] = [None] * len(rows)
        for s in samples:
            i = int(s["uid"])
            if wrong[i] is None and s["score"] == 0 and s["response"].strip():
                wrong[i] = s["response"]
        found = sum(w is not None for w in wrong)
        logger.info("sampled wrong answers for %d of %d prompts (%d samples each)", found, len(rows), n)
        return wrong

    return sample
