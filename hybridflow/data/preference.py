"""Preference data for DPO: generated preference sets, `PreferenceDataset`, and its collate.

A preference parquet file holds one pair per row, in TRL's columns:
- `prompt`: a string (templated as one user turn) or a chat message list (TRL's conversational format, and
  verl's RL layout `[{"role": "user", "content": ...}]`);
- `chosen` / `rejected`: the preferred and the dispreferred response, each a string, or a message list whose
  one message is the assistant turn (TRL's conversational format).
The column names are configurable (data.prompt_key / chosen_key / rejected_key, dotted keys walk into dict
columns), which covers verl's reward-model files (`prompt`, `chosen`, `rejected` columns) as well.

A pair with an empty side (missing, or only whitespace) or with identical chosen and rejected responses teaches
nothing: `invalid_pairs="drop"` counts and drops it (`PreferenceDataset.dropped`), "error" refuses the file
naming the row.

`build_preference_task` writes such a set for a verifiable task: the correct answer as chosen against a wrong
answer as rejected. The wrong answer is one a model sampled and the task's reward scored 0, when a sampler is
given (`WrongAnswerSampler`; `hybridflow data --preference --rejected-model M` passes one, see
cli/sampled_pairs.py), else, or where every sample was right, one made by rule (arithmetic: off by one, off by
ten, or the expression with + and - swapped). The `rejected_source` column says which ("sampled" / "rule"). Each
row also keeps the task's `data_source`, `reward_model` and `extra_info`, so the same file scores held-out accuracy
(`hybridflow generate --data`).

`PreferenceDataset` tokenises like `SFTDataset`: the prompt is the chat template with the generation prompt,
each response its text and EOS. `preference_collate` lays a batch of pairs out as rows 2i (chosen) and 2i+1
(rejected) of one engine batch, so any even split keeps a pair together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from hybridflow.data.dataset import read_parquet_table
from hybridflow.data.sft import read_column, sft_collate
from hybridflow.data.tasks import make_difficulty, make_rows

logger = logging.getLogger(__name__)

INVALID_PAIRS = ("drop", "error")
"""What PreferenceDataset does with a pair with an empty side or identical responses."""


def _arithmetic_wrong(row: dict[str, Any], rng: np.random.Generator) -> str:
    truth = int(row["reward_model"]["ground_truth"])
    expression = row["extra_info"]["expression"]
    swapped = expression.translate(str.maketrans("+-", "-+"))
    candidates = [truth + 1, truth - 1, truth + 10, truth - 10]
    if swapped != expression:
        candidates.append(_evaluate_flat(swapped))
    wrong = [c for c in candidates if c != truth]
    return str(wrong[int(rng.integers(len(wrong)))])


def _evaluate_flat(expression: str) -> int:
    """An expression of integers and + - * (as arithmetic.py writes them), with * first."""
    tokens = expression.split()
    total, term, sign = 0, int(tokens[0]), 1
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            term *= int(number)
        else:
            total, term, sign = total + sign * term, int(number), 1 if op == "+" else -1
    return total + sign * term


WRONG_ANSWERS: dict[str, Callable[[dict[str, Any], np.random.Generator], str]] = {
    "arithmetic": _arithmetic_wrong,
}
"""Tasks a preference set can be built from: verl-format row, rng -> a wrong answer the reward scores 0."""


def check_preference_task(name: str) -> None:
    """Refuse a task without a rule for wrong answers."""
    if name not in WRONG_ANSWERS:
        raise ValueError(
            f"task {name!r} has no rule for a wrong answer to build preference pairs from; preference sets exist "
            f"for {sorted(WRONG_ANSWERS)} (or set data.train_files to a preference parquet)"
        )


WrongAnswerSampler = Callable[[list[dict[str, Any]]], list[str | None]]
"""verl-format rows -> per row a response a model sampled that the task's reward scores 0, or None (none found)."""


def preference_row(row: dict[str, Any], rng: np.random.Generator, sampled: str | None = None) -> dict[str, Any]:
    """One verl RL row -> one preference row (module docstring); `sampled`: a sampled wrong answer, if any."""
    rule = WRONG_ANSWERS[row["data_source"]](row, rng)  # drawn for every row: the rng stream stays the same
    return {
        "data_source": row["data_source"],
        "prompt": row["prompt"],
        "chosen": row["reward_model"]["ground_truth"],
        "rejected": rule if sampled is None else sampled,
        "rejected_source": "rule" if sampled is None else "sampled",
        "reward_model": row["reward_model"],
        "extra_info": row["extra_info"],
    }


def build_preference_task(
    name: str,
    out_dir: str | Path,
    train_size: int,
    test_size: int,
    seed: int = 0,
    sampler: WrongAnswerSampler | None = None,
    **difficulty: Any,
) -> tuple[str, str]:
    """Write `{name}_preference_train.parquet` and `{name}_preference_test.parquet`; return their paths.

    The problems are the ones `build_task` draws with the same arguments; the wrong answers come from `sampler`
    where it found one, else from the rule and `seed`.
    """
    if train_size < 1 or test_size < 1:
        raise ValueError(f"train_size and test_size must be >= 1, got {train_size}, {test_size}")
    check_preference_task(name)
    level = make_difficulty(name, **difficulty)
    train = make_rows(name, train_size, "train", seed, level)
    seen = {row["prompt"][0]["content"] for row in train}
    test = make_rows(name, test_size, "test", seed, level, exclude=seen)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split_id, (split, rows) in enumerate((("train", train), ("test", test))):
        rng = np.random.default_rng([seed, split_id, 7])
        sampled = sampler(rows) if sampler is not None else [None] * len(rows)
        path = out / f"{name}_preference_{split}.parquet"
        pd.DataFrame([preference_row(r, rng, s) for r, s in zip(rows, sampled)]).to_parquet(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]


Pair = tuple[list[int], list[int], list[int]]
"""(prompt token ids, chosen token ids, rejected token ids), responses ending in EOS unless truncated."""


class PreferenceDataset(torch.utils.data.Dataset):
    """Tokenised preference pairs of parquet files (module docstring)."""

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        max_length: int,
        truncation: str = "error",
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        invalid_pairs: str = "drop",
    ):
        """Read `files` and tokenise every pair; bad rows fail naming file and row, invalid pairs as configured."""
        self.files = [files] if isinstance(files, (str, Path)) else list(files)
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.keys = (prompt_key, chosen_key, rejected_key)
        self.invalid_pairs = invalid_pairs
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.dropped = {"empty": 0, "identical": 0}
        """Pairs dropped for an empty side / identical responses (invalid_pairs=drop)."""
        self.pairs: list[Pair] = []
        for path in self.files:
            for i, row in enumerate(_read_table(str(path), self.keys)):
                pair = self._pair(str(path), i, row)
                if pair is not None:
                    self.pairs.append(pair)
        if any(self.dropped.values()):
            logger.warning("%s: dropped %s invalid preference pairs", ", ".join(map(str, self.files)), self.dropped)
        if not self.pairs:
            raise ValueError(
                f"{', '.join(map(str, self.files))}: no valid preference pair left ({self.dropped} dropped)"
            )

    def _pair(self, path: str, i: int, row: dict[str, Any]) -> Pair | None:
        prompt_key, chosen_key, rejected_key = self.keys
        prompt = read_column(row, prompt_key)
        if prompt is None:
            raise ValueError(f"{path}: row {i}: no value at {prompt_key!r}; set data.prompt_key to the prompt column")
        chosen = _response_text(path, i, chosen_key, read_column(row, chosen_key))
        rejected = _response_text(path, i, rejected_key, read_column(row, rejected_key))
        problem = "empty" if not chosen.strip() or not rejected.strip() else "identical" if chosen == rejected else None
        if problem is not None:
            if self.invalid_pairs == "error":
                what = "an empty chosen or rejected response" if problem == "empty" else "identical chosen and rejected"
                raise ValueError(
                    f"{path}: row {i}: {what}; fix the row, or set data.invalid_pairs=drop to count and drop such pairs"
                )
            self.dropped[problem] += 1
            return None
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(path, i, prompt)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = [self.tokenizer.eos_token_id]
        chosen_ids = self.tokenizer(chosen, add_special_tokens=False)["input_ids"] + eos
        rejected_ids = self.tokenizer(rejected, add_special_tokens=False)["input_ids"] + eos
        return self._fit(path, i, prompt_ids, chosen_ids, rejected_ids)

    def _fit(self, path: str, i: int, prompt: list[int], chosen: list[int], rejected: list[int]) -> Pair:
        excess = len(prompt) + max(len(chosen), len(rejected)) - self.max_length
        if excess <= 0:
            return prompt, chosen, rejected
        if self.truncation == "left" and excess < len(prompt):
            return prompt[excess:], chosen, rejected
        keep = self.max_length - len(prompt)
        if self.truncation == "right" and keep > 0:
            return prompt, chosen[:keep], rejected[:keep]
        raise ValueError(
            f"{path}: row {i}: {len(prompt)} prompt + {max(len(chosen), len(rejected))} response tokens exceed "
            f"data.max_length={self.max_length}; raise data.max_length or set data.truncation=left|right "
            "(left cuts the prompt's start, right the responses' ends; one side must keep a token)"
        )

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> Pair:
        return self.pairs[index]


def _response_text(path: str, i: int, key: str, value: Any) -> str:
    """A response column's text: a string, or a one-message assistant list; None counts as empty."""
    if value is None or isinstance(value, str):
        return value or ""
    messages = list(value)
    if len(messages) == 1 and isinstance(messages[0], dict) and messages[0].get("role") == "assistant":
        return str(messages[0].get("content") or "")
    raise ValueError(
        f"{path}: row {i}: column {key!r} must be a string or one assistant message "
        f"[{{'role': 'assistant', 'content': ...}}], got {str(value)[:80]!r}"
    )


def _messages(path: str, i: int, prompt: Any) -> list[dict[str, str]]:
    """A prompt column's chat messages; anything else fails naming the row."""
    messages = list(prompt) if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist") else []
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(
            f"{path}: row {i}: the prompt must be a string or a list of {{'role': ..., 'content': ...}} messages, "
            f"got {str(prompt)[:80]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _read_table(path: str, keys_: Sequence[str]) -> list[dict[str, Any]]:
    table = read_parquet_table(path)
    columns = list(dict.fromkeys(k.split(".")[0] for k in keys_))
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{path}: column(s) {missing} missing; the file has {table.column_names}: set "
            "data.prompt_key / data.chosen_key / data.rejected_key to its columns"
        )
    return table.select(columns).to_pylist()


def preference_collate(pairs: Sequence[Pair], pad_token_id: int):
    """Pairs -> one engine batch (sft_collate's layout): row 2i is pair i's chosen response, 2i+1 its rejected."""
    return sft_collate([ex for p, c, r in pairs for ex in ((p, c), (p, r))], pad_token_id)
