"""RLDataset: prompts from verl-format parquet files, templated and left-padded.

Reads any parquet with verl's columns (`prompt` chat list, `data_source`,
`reward_model.ground_truth`; `extra_info` optional), applies the tokenizer's
chat template with the generation prompt, tokenises once up front and
left-pads every prompt to `max_prompt_length`, so the last prompt token sits
at column P - 1 (see `hybridflow.protocol.keys`).

Prompts longer than `max_prompt_length` are dropped (with a logged count)
when `filter_overlong_prompts` is set; otherwise `truncation` decides:
"error" refuses them, "left" keeps their last tokens (the generation prompt
survives), "right" keeps their first tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hybridflow.protocol import collate_fn, keys

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")
VISION_COLUMNS = ("images", "videos")
"""verl's default data.image_key / data.video_key: a file with vision inputs in them is refused (no VLMs here)."""
TRUNCATIONS = ("error", "left", "right")


class RLDataset(torch.utils.data.Dataset):
    """Left-padded, tokenised prompts with the fields the reward needs."""

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        max_prompt_length: int,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
    ):
        """Read `files` (one path or a list) and tokenise every prompt."""
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        self.files = [files] if isinstance(files, (str, Path)) else list(files)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.num_filtered = 0
        """How many prompts were dropped for being longer than max_prompt_length."""
        rows = [row for path in self.files for row in read_verl_parquet(str(path))]
        token_ids = self._tokenize(rows)
        self.rows, self.token_ids = self._fit_length(rows, token_ids, filter_overlong_prompts, truncation)

    def _tokenize(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        texts = [
            self.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
            for row in rows
        ]
        # The template already holds the special tokens; adding them again would double BOS.
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _fit_length(
        self, rows: list[dict[str, Any]], token_ids: list[list[int]], filter_overlong: bool, truncation: str
    ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        limit = self.max_prompt_length
        long_ids = [i for i, ids in enumerate(token_ids) if len(ids) > limit]
        if not long_ids:
            return rows, token_ids
        if filter_overlong and len(long_ids) == len(rows):
            raise ValueError(
                f"all {len(rows)} prompts in {self.files} are longer than "
                f"data.max_prompt_length={limit}; raise data.max_prompt_length"
            )
        if filter_overlong:
            logger.warning(
                "RLDataset: dropped %d of %d prompts longer than max_prompt_length=%d", len(long_ids), len(rows), limit
            )
            keep = sorted(set(range(len(rows))) - set(long_ids))
            self.num_filtered = len(long_ids)
            return [rows[i] for i in keep], [token_ids[i] for i in keep]
        if truncation == "error":
            first = rows[long_ids[0]]
            raise ValueError(
                f"{first['_file']}: row {first['_row']}: prompt has {len(token_ids[long_ids[0]])} tokens, "
                f"more than data.max_prompt_length={limit} ({len(long_ids)} prompts are too long). "
                "Raise data.max_prompt_length, set data.filter_overlong_prompts=true, "
                "or set data.truncation=left|right"
            )
        cut = (lambda ids: ids[-limit:]) if truncation == "left" else (lambda ids: ids[:limit])
        return rows, [cut(ids) if len(ids) > limit else ids for ids in token_ids]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One row: input_ids, attention_mask, position_ids [P] and the non-tensor fields."""
        ids = self.token_ids[index]
        pad = self.max_prompt_length - len(ids)
        input_ids = torch.tensor([self.pad_token_id] * pad + ids, dtype=torch.long)
        attention_mask = torch.tensor([0] * pad + [1] * len(ids), dtype=torch.long)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        row = self.rows[index]
        return {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: position_ids,
            keys.DATA_SOURCE: row["data_source"],
            keys.GROUND_TRUTH: row["ground_truth"],
            keys.RAW_PROMPT: row["prompt"],
            keys.EXTRA_INFO: row["extra_info"],
            "index": row["index"],
        }


def read_verl_parquet(path: str) -> list[dict[str, Any]]:
    """Rows of a verl-format parquet file as Python dicts, checked column by column.

    Every row gets `ground_truth` (a string), `extra_info` (a dict), `index`
    and the `_file` / `_row` it came from; problems raise one error naming
    the file, the column and the row.
    """
    table = read_parquet_table(path)
    for column in REQUIRED_COLUMNS:
        if column not in table.column_names:
            raise ValueError(
                f"{path}: column {column!r} is missing (row 0 onwards); the file has "
                f"columns {table.column_names}, a verl-format dataset needs {list(REQUIRED_COLUMNS)}"
            )
    _refuse_vision_inputs(path, table)
    return [_check_row(path, i, row) for i, row in enumerate(table.to_pylist())]


def _refuse_vision_inputs(path: str, table: pa.Table) -> None:
    """verl would feed the rows' images / videos to a vision-language model; ignoring them would train on
    something else, so a file that has any is refused."""
    for column in VISION_COLUMNS:
        if column in table.column_names:
            rows = [i for i, v in enumerate(table.column(column).to_pylist()) if v not in (None, [], "")]
            if rows:
                raise ValueError(
                    f"{path}: column {column!r} holds vision inputs (row {rows[0]} onwards; verl reads them as "
                    f"data.{column[:-1]}_key); hybridflow has no vision-language models yet: drop the column "
                    "to train on the text alone"
                )


def read_parquet_table(path: str) -> pa.Table:
    """The parquet file at `path`; a missing or unreadable file fails naming it."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None


def check_messages(path: str, i: int, column: str, messages: Any) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} dicts of strings; else one error naming the file, row and column."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    ok = isinstance(messages, list) and messages and all(_is_message(m) for m in messages)
    if not ok:
        raise ValueError(
            f"{path}: row {i}: column {column!r} must be a non-empty list of {{'role', 'content'}} messages "
            f"with string values, got {str(messages)[:120]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _check_row(path: str, i: int, row: dict[str, Any]) -> dict[str, Any]:
    prompt = check_messages(path, i, "prompt", row["prompt"])
    reward = row["reward_model"]
    if not isinstance(reward, dict) or reward.get("ground_truth") is None:
        raise ValueError(f"{path}: row {i}: column 'reward_model' has no 'ground_truth' (got {reward!r})")
    if row["data_source"] is None or str(row["data_source"]) == "":
        raise ValueError(f"{path}: row {i}: column 'data_source' is empty")
    truth = reward["ground_truth"]
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(
            f"{path}: row {i}: column 'extra_info' must be a dict (a parquet struct) or null, got a "
            f"{type(extra).__name__} {str(extra)[:60]!r}"
        )
    extra = extra or {}
    return {
        "prompt": prompt,
        "data_source": str(row["data_source"]),
        "ground_truth": truth if isinstance(truth, str) else json.dumps(truth),
        "extra_info": extra,
        "index": extra.get("index", i),
        "_file": path,
        "_row": i,
    }


def collate(rows: Sequence[dict[str, Any]]):
    """Items of an RLDataset to one DataProto (tensors stacked, the rest as object arrays)."""

    return collate_fn(rows)
