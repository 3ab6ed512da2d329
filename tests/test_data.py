"""Task builders, RLDataset on the real SmolLM2 tokenizer, and the resumable loader."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from hybridflow.data import TASKS, build_task
from hybridflow.data.dataset import RLDataset, collate
from hybridflow.data.loader import StatefulDataLoader
from hybridflow.protocol import DataProto, keys
from hybridflow.rewards import default_compute_score
from hybridflow.rewards.countdown import evaluate
from tests.data_helpers import smol_tokenizer

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


@pytest.fixture(scope="session")
def tokenizer():
    return smol_tokenizer()


@pytest.mark.parametrize("task", ["arithmetic", "gsm8k", "countdown"])
def test_builder_writes_deterministic_verl_parquet(tmp_path, task):
    train, test = build_task(task, tmp_path / "a", train_size=40, test_size=10, seed=3)
    again, _ = build_task(task, tmp_path / "b", train_size=40, test_size=10, seed=3)
    other, _ = build_task(task, tmp_path / "c", train_size=40, test_size=10, seed=4)
    df, df_test = pd.read_parquet(train), pd.read_parquet(test)
    assert list(df.columns) == VERL_COLUMNS and len(df) == 40 and len(df_test) == 10
    assert df.equals(pd.read_parquet(again))
    assert (
        not df["prompt"]
        .map(lambda p: p[0]["content"])
        .equals(pd.read_parquet(other)["prompt"].map(lambda p: p[0]["content"]))
    )
    row = df.iloc[0]
    assert row["data_source"] == TASKS[task].data_source
    assert list(row["prompt"][0]) == ["role", "content"] and row["prompt"][0]["role"] == "user"
    assert row["reward_model"]["style"] == "rule" and isinstance(row["reward_model"]["ground_truth"], str)
    assert (row["extra_info"]["split"], row["extra_info"]["index"]) == ("train", 0)
    assert set(df_test["extra_info"].map(lambda e: e["split"])) == {"test"}
    train_q = set(df["prompt"].map(lambda p: p[0]["content"]))
    assert not train_q & set(df_test["prompt"].map(lambda p: p[0]["content"]))


def test_generated_reference_answers_score_one(tmp_path):
    """Each task's worked solution passes its scorer; arithmetic truths match an independent evaluator."""
    for task, solution in (
        ("gsm8k", lambda e: e["answer"]),
        ("countdown", lambda e: "#### " + e["solution"]),
        ("arithmetic", lambda e: f"#### {evaluate(e['expression'])[0]}"),
    ):
        train, _ = build_task(task, tmp_path, train_size=30, test_size=2, seed=0)
        for _, row in pd.read_parquet(train).iterrows():
            truth = row["reward_model"]["ground_truth"]
            assert default_compute_score(row["data_source"], solution(row["extra_info"]), truth) == 1.0


def test_difficulty_knobs_and_errors(tmp_path, caplog):
    train, _ = build_task(
        "arithmetic", tmp_path, 50, 5, seed=0, num_operands=3, min_digits=3, max_digits=3, operators="+-*"
    )
    exprs = pd.read_parquet(train)["extra_info"].map(lambda e: e["expression"].split())
    assert all(len(e) == 5 and all(len(n) == 3 for n in e[::2]) for e in exprs)
    assert {op for e in exprs for op in e[1::2]} == {"+", "-", "*"}
    with caplog.at_level(logging.WARNING):
        build_task("arithmetic", tmp_path, 200, 20, max_digits=1)  # only 100 distinct problems
    assert re.search(r"[1-9]\d* of 20 test problems also occur in the train split", caplog.text)
    with pytest.raises(TypeError, match="max_digit.*did you mean.*max_digits"):
        build_task("arithmetic", tmp_path, 5, 5, max_digit=2)
    with pytest.raises(ValueError, match="operators"):
        build_task("arithmetic", tmp_path, 5, 5, operators="/")
    with pytest.raises(KeyError, match="data.task='nope' is not a registered task; known: arithmetic"):
        build_task("nope", tmp_path, 5, 5)
    _, test = build_task("countdown", tmp_path, 5, 5, num_numbers=4)
    truth = json.loads(pd.read_parquet(test)["reward_model"][0]["ground_truth"])
    assert len(truth["numbers"]) == 4 and isinstance(truth["target"], int)


def test_dataset_left_pads_and_collates(tmp_path, tokenizer):
    train, test = build_task("arithmetic", tmp_path, 12, 4, seed=0)
    ds = RLDataset([train, test], tokenizer, max_prompt_length=64)
    assert len(ds) == 16 and ds.num_filtered == 0
    item = ds[0]
    text = tokenizer.apply_chat_template(item[keys.RAW_PROMPT], add_generation_prompt=True, tokenize=False)
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(want)
    assert item[keys.INPUT_IDS][-n:].tolist() == want
    assert (item[keys.INPUT_IDS][:-n] == tokenizer.pad_token_id).all()
    assert item[keys.ATTENTION_MASK].tolist() == [0] * (64 - n) + [1] * n
    assert item[keys.POSITION_IDS][-n:].tolist() == list(range(n)) and item[keys.POSITION_IDS][0] == 0
    assert tokenizer.decode(item[keys.INPUT_IDS][-n:]).endswith("<|im_start|>assistant\n")
    batch = collate([ds[i] for i in range(5)])
    assert isinstance(batch, DataProto) and batch.batch[keys.INPUT_IDS].shape == (5, 64)
    assert list(batch.non_tensor_batch[keys.DATA_SOURCE]) == ["arithmetic"] * 5
    assert batch.non_tensor_batch[keys.GROUND_TRUTH][0] == ds.rows[0]["ground_truth"]
    assert list(batch.non_tensor_batch["index"]) == [0, 1, 2, 3, 4]


def _lengths(ds_rows, tokenizer):
    return [
        len(
            tokenizer(
                tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )["input_ids"]
        )
        for r in ds_rows
    ]


def test_overlong_prompts_filter_error_truncate(tmp_path, tokenizer, caplog):
    train, _ = build_task("gsm8k", tmp_path, 20, 2, seed=0)
    full = RLDataset(train, tokenizer, max_prompt_length=512)
    lengths = _lengths(full.rows, tokenizer)
    limit = sorted(lengths)[len(lengths) // 2]
    with caplog.at_level(logging.WARNING):
        kept = RLDataset(train, tokenizer, max_prompt_length=limit)
    assert len(kept) == sum(n <= limit for n in lengths) and kept.num_filtered == sum(n > limit for n in lengths)
    assert f"dropped {kept.num_filtered} of 20" in caplog.text
    with pytest.raises(ValueError, match=r"gsm8k_train.parquet: row \d+: prompt has \d+ tokens.*max_prompt_length"):
        RLDataset(train, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False)
    with pytest.raises(ValueError, match="all 20 prompts .* are longer than data.max_prompt_length=5"):
        RLDataset(train, tokenizer, max_prompt_length=5)
    longest = max(range(20), key=lambda i: lengths[i])
    left = RLDataset(train, tokenizer, limit, filter_overlong_prompts=False, truncation="left")
    right = RLDataset(train, tokenizer, limit, filter_overlong_prompts=False, truncation="right")
    assert len(left) == 20 and left[longest][keys.ATTENTION_MASK].all()
    assert left[longest][keys.INPUT_IDS].tolist() == full.token_ids[longest][-limit:]
    assert right[longest][keys.INPUT_IDS].tolist() == full.token_ids[longest][:limit]


def test_dataset_errors_name_file_column_row(tmp_path, tokenizer):
    train, _ = build_task("arithmetic", tmp_path, 6, 2, seed=0)
    df = pd.read_parquet(train)
    df.drop(columns=["reward_model"]).to_parquet(tmp_path / "nocol.parquet")
    with pytest.raises(ValueError, match=r"nocol.parquet: column 'reward_model' is missing"):
        RLDataset(str(tmp_path / "nocol.parquet"), tokenizer, 64)
    df["reward_model"] = [{"style": "rule", "ground_truth": None if i == 4 else "1"} for i in range(len(df))]
    df.to_parquet(tmp_path / "norow.parquet")
    with pytest.raises(ValueError, match=r"norow.parquet: row 4: column 'reward_model' has no 'ground_truth'"):
        RLDataset(str(tmp_path / "norow.parquet"), tokenizer, 64)
    df["reward_model"] = [{"style": "rule", "ground_truth": "1"}] * len(df)
    df["images"] = [None] * len(df)  # verl's image column, empty: read as text
    df.to_parquet(tmp_path / "noimages.parquet")
    assert len(RLDataset(str(tmp_path / "noimages.parquet"), tokenizer, 64)) == len(df)
    df["images"] = [None, None, [{"image": "x.png"}]] + [None] * (len(df) - 3)
    df.to_parquet(tmp_path / "images.parquet")
    with pytest.raises(ValueError, match=r"images.parquet: column 'images' holds vision inputs \(row 2 onwards"):
        RLDataset(str(tmp_path / "images.parquet"), tokenizer, 64)
    (tmp_path / "bad.parquet").write_text("data_source,prompt\nx,y\n")
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable parquet file"):
        RLDataset([train, str(tmp_path / "bad.parquet")], tokenizer, 64)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLDataset(str(tmp_path / "missing.parquet"), tokenizer, 64)


def test_loader_resume_equals_uninterrupted():
    data = list(range(23))
    full = StatefulDataLoader(data, batch_size=5, seed=7)
    assert len(full) == 4
    reference = [batch for _ in range(3) for batch in full]
    assert reference[:4] != reference[4:8]  # a new order each epoch
    first = StatefulDataLoader(data, batch_size=5, seed=7)
    got = list(first)  # epoch 0
    it = iter(first)
    got += [next(it), next(it)]  # stop in the middle of epoch 1
    state = first.state_dict()
    assert state == {"epoch": 1, "batch_in_epoch": 2, "seed": 7}
    resumed = StatefulDataLoader(data, batch_size=5, seed=7)
    resumed.load_state_dict(state)
    for _ in range(resumed.epoch, 3):
        got.extend(resumed)
    assert got == reference
    with pytest.raises(ValueError, match="seed 7.*data.seed=8"):
        StatefulDataLoader(data, batch_size=5, seed=8).load_state_dict(state)


def test_loader_state_at_epoch_end_and_no_shuffle():
    loader = StatefulDataLoader(list(range(10)), batch_size=5, seed=0, shuffle=False)
    batches = []
    for batch in loader:
        batches.append(batch)
        state = loader.state_dict()
    assert batches == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert state == {"epoch": 1, "batch_in_epoch": 0, "seed": 0} and loader.epoch == 1
    tail = StatefulDataLoader(list(range(7)), batch_size=3, shuffle=False, drop_last=False)
    assert len(tail) == 3 and list(tail) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="fewer than one batch"):
        StatefulDataLoader(list(range(3)), batch_size=5)


def test_loader_over_dataset_yields_dataproto(tmp_path, tokenizer):
    train, _ = build_task("countdown", tmp_path, 8, 2, seed=1)
    loader = StatefulDataLoader(RLDataset(train, tokenizer, 128), batch_size=4, seed=0, collate_fn=collate)
    batches = list(loader)
    assert len(batches) == 2 and all(isinstance(b, DataProto) and len(b) == 4 for b in batches)
    seen = sorted(i for b in batches for i in b.non_tensor_batch["index"])
    assert seen == list(range(8))
    assert batches[0].batch[keys.ATTENTION_MASK].dtype == torch.long


def test_task_files_generate_once_atomically_into_the_cache(tmp_path, monkeypatch):
    from hybridflow.config.data import DataConfig
    from hybridflow.train import data_setup
    from hybridflow.train.data_setup import task_files

    cfg = DataConfig(task="arithmetic", task_dir=str(tmp_path), gen_train_size=6, gen_val_size=3)
    real_build = data_setup.build_task

    def killed(name, out_dir, *args, **kwargs):
        real_build(name, out_dir, *args, **kwargs)
        raise KeyboardInterrupt("killed after writing")

    monkeypatch.setattr(data_setup, "build_task", killed)
    with pytest.raises(KeyboardInterrupt):
        task_files(cfg)
    assert list(tmp_path.iterdir()) == []  # nothing a later run could mistake for a finished cache
    monkeypatch.setattr(data_setup, "build_task", real_build)
    train, val = task_files(cfg)
    assert len(pd.read_parquet(train[0])) == 6 and len(pd.read_parquet(val[0])) == 3
    assert [p.name for p in tmp_path.iterdir()] == [Path(train[0]).parent.name]
    monkeypatch.setattr(data_setup, "build_task", killed)  # a second call reuses the cache: no build at all
    assert task_files(cfg) == (train, val)
