"""Supervised fine-tuning data: generated SFT sets, `SFTDataset`, and its collate.

An SFT parquet file holds verl's SFT layouts; `build_sft_task` writes all of them for the
built-in tasks whose correct response is known:
- `prompt` (str): the question, `response` (str): the answer in the format the task's
  reward scorer reads (arithmetic: the number; gsm8k: the worked solution ending `#### N`);
- `messages` (list): the same as a chat, `[{"role": "user", ...}, {"role": "assistant", ...}]`;
- `data_source`, `extra_info` (with `question` and `answer`, verl's extra_info.question layout).

Multi-turn tasks (`SFT_TRANSCRIPTS`, e.g. tool_arithmetic) write `messages`, `data_source` and
`extra_info` only, one row per assistant turn of the ideal episode: row k holds the episode up
to and including its k-th assistant turn, so `SFTDataset(..., messages_key="messages")`, which
trains the last assistant turn of a row, trains every assistant turn once (the tool call and
the answer). They have no prompt/response columns: a single pair cannot hold an episode.

`SFTDataset` tokenises with the model's chat template: the prompt is the template of the
conversation up to the response with the generation prompt, the response is the answer
text followed by EOS. Only response tokens carry loss (`response_mask`); with a messages
column the response is the LAST assistant turn and every earlier turn is prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from hybridflow.data.dataset import check_messages, read_parquet_table
from hybridflow.data.tasks import make_difficulty, make_rows
from hybridflow.data.tool_arithmetic import transcript
from hybridflow.protocol import DataProto, keys

SFT_RESPONSES: dict[str, Callable[[dict[str, Any]], str]] = {
    "arithmetic": lambda row: row["reward_model"]["ground_truth"],
    "gsm8k": lambda row: row["extra_info"]["answer"],
}
"""Tasks with a known correct response: verl-format row -> the response the reward scores 1.0."""


def _tool_arithmetic_transcript(row: dict[str, Any]) -> list[dict[str, str]]:
    return transcript(row)


SFT_TRANSCRIPTS: dict[str, Callable[[dict[str, Any]], list[dict[str, str]]]] = {
    "tool_arithmetic": _tool_arithmetic_transcript,
    "tool_sum_products": _tool_arithmetic_transcript,  # one call on the whole expression
}
"""Multi-turn tasks with a known ideal episode: verl-format row -> its chat messages."""


def check_sft_task(name: str, messages_key: str | None = None) -> None:
    """Refuse a task that has no known correct response, and a multi-turn task read without its messages."""
    if name not in SFT_RESPONSES and name not in SFT_TRANSCRIPTS:
        raise ValueError(
            f"task {name!r} has no known correct response to fine-tune on; SFT sets exist for "
            f"{sorted(SFT_RESPONSES) + sorted(SFT_TRANSCRIPTS)} (or set data.train_files)"
        )
    if name in SFT_TRANSCRIPTS and messages_key != "messages":
        raise ValueError(
            f"task {name!r} is multi-turn: its SFT set holds only a `messages` column; set data.messages_key=messages"
        )


def sft_row(row: dict[str, Any]) -> dict[str, Any]:
    """One verl RL row of a task in SFT_RESPONSES -> one SFT row (module docstring)."""
    question = row["prompt"][-1]["content"]
    answer = SFT_RESPONSES[row["data_source"]](row)
    return {
        "data_source": row["data_source"],
        "prompt": question,
        "response": answer,
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        "extra_info": {**row["extra_info"], "question": question, "answer": answer},
    }


def sft_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The SFT rows of one verl RL row: one (`sft_row`), or one per assistant turn of a transcript."""
    make = SFT_TRANSCRIPTS.get(row["data_source"])
    if make is None:
        return [sft_row(row)]
    messages = make(row)
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [
        {"data_source": row["data_source"], "messages": messages[:end], "extra_info": row["extra_info"]} for end in ends
    ]


def build_sft_task(
    name: str, out_dir: str | Path, train_size: int, test_size: int, seed: int = 0, **difficulty: Any
) -> tuple[str, str]:
    """Write `{name}_sft_train.parquet` and `{name}_sft_test.parquet`; return their paths.

    The problems are the ones `build_task` draws with the same arguments.
    """
    if train_size < 1 or test_size < 1:
        raise ValueError(f"train_size and test_size must be >= 1, got {train_size}, {test_size}")
    check_sft_task(name, messages_key="messages")  # the files are written, not read, here
    level = make_difficulty(name, **difficulty)
    train = make_rows(name, train_size, "train", seed, level)
    seen = {row["prompt"][0]["content"] for row in train}
    test = make_rows(name, test_size, "test", seed, level, exclude=seen)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, rows in (("train", train), ("test", test)):
        path = out / f"{name}_sft_{split}.parquet"
        pd.DataFrame([out for r in rows for out in sft_rows(r)]).to_parquet(path, index=False)
        paths.append(str(path))
    return paths[0], paths[1]


def read_column(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, where a dotted key walks into dict columns (extra_info.question)."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


class SFTDataset(torch.utils.data.Dataset):
    """Tokenised (prompt ids, response ids) pairs of SFT parquet files."""

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: Any,
        max_length: int,
        truncation: str = "error",
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str | None = None,
    ):
        """Read `files` and tokenise every example (module docstring); bad rows fail naming file and row."""
        self.files = [files] if isinstance(files, (str, Path)) else list(files)
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.prompt_key, self.response_key, self.messages_key = prompt_key, response_key, messages_key
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.examples = [
            self._example(str(path), i, row)
            for path in self.files
            for i, row in enumerate(_read_table(str(path), self._columns()))
        ]

    def _columns(self) -> list[str]:
        keys_ = [self.messages_key] if self.messages_key else [self.prompt_key, self.response_key]
        return [k.split(".")[0] for k in keys_]

    def _conversation(self, path: str, i: int, row: dict[str, Any]) -> tuple[list[dict], str]:
        """(messages before the response, response text) of one row."""
        if self.messages_key:
            messages = check_messages(path, i, self.messages_key, read_column(row, self.messages_key))
            last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None:
                raise ValueError(f"{path}: row {i}: column {self.messages_key!r} has no assistant turn to train on")
            return messages[:last], messages[last]["content"]
        prompt, response = read_column(row, self.prompt_key), read_column(row, self.response_key)
        for key, value in ((self.prompt_key, prompt), (self.response_key, response)):
            if value is None:
                raise ValueError(
                    f"{path}: row {i}: no value at {key!r}; set data.prompt_key / data.response_key "
                    "to the columns holding them (or data.messages_key for a chat column)"
                )
        if isinstance(response, bool) or not isinstance(response, (str, int, float)):
            raise ValueError(
                f"{path}: row {i}: column {self.response_key!r} must be a string, got a {type(response).__name__} "
                f"{str(response)[:60]!r}"
            )
        return check_messages(path, i, self.prompt_key, prompt), str(response)

    def _example(self, path: str, i: int, row: dict[str, Any]) -> tuple[list[int], list[int]]:
        messages, response = self._conversation(path, i, row)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        response_ids = self.tokenizer(response, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return self._fit(path, i, prompt_ids, response_ids)

    def _fit(self, path: str, i: int, prompt: list[int], response: list[int]) -> tuple[list[int], list[int]]:
        excess = len(prompt) + len(response) - self.max_length
        if excess <= 0:
            return prompt, response
        if self.truncation == "left" and excess < len(prompt):
            return prompt[excess:], response
        if self.truncation == "right" and excess < len(response):
            return prompt, response[: len(response) - excess]
        raise ValueError(
            f"{path}: row {i}: {len(prompt)} prompt + {len(response)} response tokens exceed "
            f"data.max_length={self.max_length}; raise data.max_length or set data.truncation=left|right "
            "(left cuts the prompt's start, right the response's end; one side must keep a token)"
        )

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        """(prompt token ids, response token ids ending in EOS unless truncated)."""
        return self.examples[index]


def _read_table(path: str, columns: list[str]) -> list[dict[str, Any]]:
    table = read_parquet_table(path)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(
            f"{path}: column(s) {missing} missing; the file has {table.column_names}: set "
            "data.prompt_key/data.response_key (or data.messages_key) to its columns"
        )
    return table.select(list(dict.fromkeys(columns))).to_pylist()


def sft_collate(examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int):
    """Examples -> DataProto in the engine layout: prompts left-padded | responses right-padded (keys.py)."""

    prompt_len = max(len(p) for p, _ in examples)
    resp_len = max(len(r) for _, r in examples)
    ids = torch.full((len(examples), prompt_len + resp_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, response) in enumerate(examples):
        start = prompt_len - len(prompt)
        ids[row, start : prompt_len + len(response)] = torch.tensor(prompt + response)
        mask[row, start : prompt_len + len(response)] = 1
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: ids[:, prompt_len:].clone(),
            keys.RESPONSE_MASK: mask[:, prompt_len:].clone(),
        }
    )
