"""SFT on a tiny random Llama: the worker's step against a hand-written loop, response-only masking,
packing against unpacked, 2 gloo ranks against 1, and the SFT data files. (That packed examples never
attend to each other is tests/test_engine_logprobs.py's.)"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.algos.core import GlobalNorm
from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.data.sft import SFTDataset, build_sft_task, sft_collate
from hybridflow.engine import EngineConfig, OptimConfig
from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir
from hybridflow.protocol import DataProto, keys
from hybridflow.rewards.registry import default_compute_score
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.sft import SFTWorker, nll_loss_fn

LR, ROWS, MICRO = 1e-3, 6, 2


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def batch(model_dir: Path, tmp_path_factory) -> DataProto:
    """6 arithmetic SFT examples, sorted by response length (rank 0 of 2 gets the short ones)."""
    out = tmp_path_factory.mktemp("sft")
    train, _ = build_sft_task("arithmetic", out, 24, 4, seed=1, max_digits=3)
    data = SFTDataset(train, load_tokenizer(model_dir), max_length=128)
    examples = sorted(data.examples, key=lambda e: len(e[1]))
    picked = examples[:3] + examples[-3:]
    assert len(picked[0][1]) < len(picked[-1][1])  # uneven token counts per rank
    return sft_collate(picked, data.pad_token_id)


def _worker_group(model_dir: Path, **engine) -> LocalWorkerGroup:
    cls = ClassWithInitArgs(
        SFTWorker,
        ModelConfig(path=str(model_dir)),
        EngineConfig(param_dtype="fp32", **engine),
        OptimConfig(lr=LR, total_training_steps=10),
        MICRO,
    )
    group = LocalWorkerGroup(LocalResourcePool(), cls)
    group.init_model()
    return group


def _hand_written_step(model_dir: Path, data: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain HF model, padded batch, NLL of the response tokens only, clip, one AdamW step."""
    model = load_causal_lm(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    resp = data[keys.RESPONSES].shape[1]
    logits = model(
        input_ids=data[keys.INPUT_IDS], attention_mask=data[keys.ATTENTION_MASK], position_ids=data[keys.POSITION_IDS]
    ).logits[:, -resp - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    mask = data[keys.RESPONSE_MASK].float()
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach()), {k: v.detach() for k, v in model.state_dict().items()}


def test_first_step_matches_hand_written_loop_and_loss_goes_down(model_dir, batch):
    group = _worker_group(model_dir)
    want_loss, want_params = _hand_written_step(model_dir, dict(batch.batch.items()))
    first = group.train_batch(batch).meta_info["metrics"]
    assert first["train/loss"] == pytest.approx(want_loss, rel=1e-5)
    got = group._worker.engine.full_state_dict()
    for name, value in want_params.items():
        torch.testing.assert_close(got[name], value, atol=5e-6, rtol=1e-4, msg=name)
    losses = [group.train_batch(batch).meta_info["metrics"]["train/loss"] for _ in range(3)]
    assert losses[-1] < first["train/loss"] - 0.1
    assert first["train/response_tokens"] == float(batch.batch[keys.RESPONSE_MASK].sum())


def test_export_hf_writes_the_trained_weights(model_dir, batch, tmp_path):
    from transformers import AutoModelForCausalLM

    group = _worker_group(model_dir)
    group.train_batch(batch)
    group.export_hf(str(tmp_path / "hf"), str(model_dir))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    for name, value in group._worker.engine.full_state_dict().items():
        torch.testing.assert_close(loaded[name], value, msg=name)
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()


def test_only_response_tokens_carry_loss(batch):
    # Hand-computed: rows of log-probs with 2 + 1 response tokens out of 3 columns; 3 global tokens, 1 rank.
    log_probs = torch.tensor([[-1.0, -2.0, -7.0], [-3.0, -9.0, -9.0]])
    micro = {keys.RESPONSE_MASK: torch.tensor([[1, 1, 0], [1, 0, 0]])}
    loss, _ = nll_loss_fn(GlobalNorm(num_tokens=3, num_seqs=2, dp_size=1))({"log_probs": log_probs}, micro)
    assert float(loss) == pytest.approx((1 + 2 + 3) / 3)
    # the collated batch masks exactly each example's response (answer + EOS), never a prompt token
    mask, resp_mask = batch.batch[keys.ATTENTION_MASK], batch.batch[keys.RESPONSE_MASK]
    resp = resp_mask.shape[1]
    assert torch.equal(resp_mask, mask[:, -resp:])
    eos = load_tokenizer(tiny_model_dir("llama")).eos_token_id
    last = resp_mask.sum(-1) - 1
    assert torch.all(batch.batch[keys.RESPONSES].gather(1, last.unsqueeze(1)) == eos)


def test_packing_gives_the_same_loss_and_update(model_dir, batch):
    plain, packed = _worker_group(model_dir), _worker_group(model_dir, packing=True)
    a = plain.train_batch(batch).meta_info["metrics"]
    b = packed.train_batch(batch).meta_info["metrics"]
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    pa, pb = plain._worker.engine.full_state_dict(), packed._worker.engine.full_state_dict()
    for name in pa:
        torch.testing.assert_close(pb[name], pa[name], atol=5e-6, rtol=1e-4, msg=name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dp_rank(rank: int, port: int, out: str, model_dir: str, shard_file: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    worker = SFTWorker(
        ModelConfig(path=model_dir),
        EngineConfig(param_dtype="fp32"),
        OptimConfig(lr=LR, total_training_steps=10),
        MICRO,
    )
    worker.init_model()
    shard = torch.load(shard_file, weights_only=False).chunk(2)[rank]
    metrics = worker.train_batch(shard).meta_info["metrics"]
    params = worker.engine.full_state_dict()
    if rank == 0:
        torch.save({"metrics": metrics, "params": params}, Path(out) / "dp2.pt")
    torch.distributed.barrier()
    os._exit(0)  # no group teardown (see test_engine_distributed)


def test_two_ranks_match_one(model_dir, batch, tmp_path):
    torch.save(batch, tmp_path / "batch.pt")
    mp.spawn(
        _dp_rank, args=(_free_port(), str(tmp_path), str(model_dir), str(tmp_path / "batch.pt")), nprocs=2, join=True
    )
    two = torch.load(tmp_path / "dp2.pt", weights_only=False)
    one = _worker_group(model_dir)
    want = one.train_batch(batch).meta_info["metrics"]
    assert two["metrics"]["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)
    assert two["metrics"]["train/response_tokens"] == want["train/response_tokens"]
    params = one._worker.engine.full_state_dict()
    for name, value in params.items():
        torch.testing.assert_close(two["params"][name], value, atol=5e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("task", ["arithmetic", "gsm8k"])
def test_sft_task_files_hold_every_layout_with_responses_the_reward_accepts(tmp_path, task):
    train, test = build_sft_task(task, tmp_path, 8, 4, seed=0)
    frame = pd.read_parquet(train)
    assert {"prompt", "response", "messages", "data_source", "extra_info"} <= set(frame.columns)
    for _, row in frame.iterrows():
        assert row["messages"][-1]["content"] == row["response"] == row["extra_info"]["answer"]
        assert row["messages"][0]["content"] == row["prompt"] == row["extra_info"]["question"]
        truth = RL_ROWS[task](row)
        assert default_compute_score(row["data_source"], row["response"], truth) == 1.0
    assert len(pd.read_parquet(test)) == 4


RL_ROWS = {"arithmetic": lambda row: row["response"], "gsm8k": lambda row: row["response"].rsplit("####", 1)[1].strip()}
"""The ground truth each task's scorer compares against, read back from an SFT row."""


def test_multi_turn_chat_trains_on_the_last_assistant_turn_only(model_dir, tmp_path):
    chat = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    path = tmp_path / "chat.parquet"
    pd.DataFrame([{"conversation": chat}]).to_parquet(path)
    tok = load_tokenizer(model_dir)
    prompt, response = SFTDataset(str(path), tok, 128, messages_key="conversation")[0]
    text = tok.apply_chat_template(chat[:3], add_generation_prompt=True, tokenize=False)
    assert prompt == tok(text, add_special_tokens=False)["input_ids"]  # earlier turns, "2" included: masked
    assert response == tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    left = SFTDataset(str(path), tok, len(prompt), messages_key="conversation", truncation="left")[0]
    assert left == (prompt[len(response) :], response)  # the prompt's start is cut, the response kept whole


def test_layouts_give_the_same_examples_and_bad_columns_name_the_fix(model_dir, tmp_path):
    train, _ = build_sft_task("arithmetic", tmp_path, 8, 4, seed=0)
    tok = load_tokenizer(model_dir)
    plain = SFTDataset(train, tok, max_length=128).examples
    assert SFTDataset(train, tok, 128, messages_key="messages").examples == plain
    dotted = SFTDataset(train, tok, 128, prompt_key="extra_info.question", response_key="extra_info.answer")
    assert dotted.examples == plain
    with pytest.raises(ValueError, match=r"column\(s\) \['question'\] missing.*data.prompt_key"):
        SFTDataset(train, tok, 128, prompt_key="question")
    with pytest.raises(ValueError, match="exceed data.max_length=5.*data.truncation"):
        SFTDataset(train, tok, 5)
    right = SFTDataset(train, tok, len(plain[0][0]) + 1, truncation="right").examples[0]
    assert right == (plain[0][0], plain[0][1][:1])
