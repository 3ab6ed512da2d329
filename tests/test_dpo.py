"""DPO's worker against a hand-written step on a plain HF model, and the preference data: generated sets,
the TRL / verl column layouts, invalid pairs (dropped and counted, or refused) and the pair layout of a batch."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from hybridflow.algos.dpo import DPOLossConfig
from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.data.preference import PreferenceDataset, build_preference_task, preference_collate
from hybridflow.engine import EngineConfig, OptimConfig
from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir
from hybridflow.protocol import DataProto, keys
from hybridflow.rewards.registry import default_compute_score
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.dpo import DPOWorker

LR, BETA, PAIRS = 1e-3, 0.5, 3


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def batch(model_dir: Path, tmp_path_factory) -> DataProto:
    out = tmp_path_factory.mktemp("pref")
    train, _ = build_preference_task("arithmetic", out, 8, 2, seed=1, max_digits=3)
    data = PreferenceDataset(train, load_tokenizer(model_dir), max_length=128)
    return preference_collate(data.pairs[:PAIRS], data.pad_token_id)


def _seq_logps(model, data: dict) -> torch.Tensor:
    """Summed response log-probs of every row of a padded batch, plain HF forward."""
    resp = data[keys.RESPONSES].shape[1]
    logits = model(
        input_ids=data[keys.INPUT_IDS], attention_mask=data[keys.ATTENTION_MASK], position_ids=data[keys.POSITION_IDS]
    ).logits[:, -resp - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    return (logp * data[keys.RESPONSE_MASK].float()).sum(-1)


def test_worker_step_matches_hand_written_dpo_and_uses_the_frozen_reference(model_dir, batch):
    cls = ClassWithInitArgs(
        DPOWorker,
        ModelConfig(path=str(model_dir)),
        EngineConfig(param_dtype="fp32"),
        OptimConfig(lr=LR, total_training_steps=10),
        1,  # one pair per micro-batch: three forwards
        DPOLossConfig(beta=BETA),
    )
    group = LocalWorkerGroup(LocalResourcePool(), cls)
    group.init_model()
    data = dict(batch.batch.items())

    model, ref = load_causal_lm(model_dir), load_causal_lm(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    with torch.no_grad():
        ref_logps = _seq_logps(ref, data)
    z = (_seq_logps(model, data) - ref_logps).view(PAIRS, 2)
    loss = -F.logsigmoid(BETA * (z[:, 0] - z[:, 1])).mean()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()

    first = group.train_batch(batch).meta_info["metrics"]
    assert first["train/loss"] == pytest.approx(math.log(2), rel=1e-5)  # the policy starts as its reference
    assert first["train/rewards/margins"] == pytest.approx(0, abs=1e-5)  # train and inference forwards: rounding
    assert first["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)  # the loss's scale (Adam hides it)
    got = group._worker.engine.full_state_dict()
    for name, value in model.state_dict().items():
        # 5% of one Adam step (lr): the first step is sign-like, so a gradient near 0 may round either way
        torch.testing.assert_close(got[name], value.detach(), atol=LR / 20, rtol=0, msg=name)

    with torch.no_grad():  # step 2 sees the updated policy against the unchanged reference
        rewards = (BETA * (_seq_logps(model, data) - ref_logps)).view(PAIRS, 2)
    second = group.train_batch(batch).meta_info["metrics"]
    assert second["train/rewards/chosen"] == pytest.approx(float(rewards[:, 0].mean()), abs=1e-5)
    assert second["train/rewards/rejected"] == pytest.approx(float(rewards[:, 1].mean()), abs=1e-5)
    assert second["train/rewards/margins"] == pytest.approx(float((rewards[:, 0] - rewards[:, 1]).mean()), abs=1e-5)
    assert second["train/rewards/margins"] > 0


def test_generated_pairs_hold_a_right_and_a_wrong_answer(tmp_path):
    train, test = build_preference_task("arithmetic", tmp_path, 32, 4, seed=0, num_operands=3, operators="+-*")
    frame = pd.read_parquet(train)
    assert {"prompt", "chosen", "rejected", "data_source", "reward_model", "extra_info"} <= set(frame.columns)
    for _, row in frame.iterrows():
        truth = row["reward_model"]["ground_truth"]
        assert row["prompt"][0]["role"] == "user" and row["chosen"] == truth
        assert default_compute_score("arithmetic", row["chosen"], truth) == 1.0
        assert default_compute_score("arithmetic", row["rejected"], truth) == 0.0
    assert len(pd.read_parquet(test)) == 4
    again, _ = build_preference_task("arithmetic", tmp_path / "again", 32, 4, seed=0, num_operands=3, operators="+-*")
    assert pd.read_parquet(again)["rejected"].tolist() == frame["rejected"].tolist()  # deterministic per seed


def _write(tmp_path: Path, rows: list[dict], name: str = "pairs.parquet") -> str:
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path, index=False)
    return str(path)


def test_trl_string_and_conversational_layouts_give_the_same_pairs(model_dir, tmp_path):
    tok = load_tokenizer(model_dir)
    standard = _write(tmp_path, [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}], "standard.parquet")
    chat = _write(
        tmp_path,
        [
            {
                "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
                "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "5"}],
            }
        ],
        "chat.parquet",
    )
    nested = _write(
        tmp_path,
        [{"extra_info": {"question": "What is 2 + 2?", "good": "4", "bad": "5"}}],
        "nested.parquet",
    )
    a = PreferenceDataset(standard, tok, max_length=64).pairs
    b = PreferenceDataset(chat, tok, max_length=64).pairs
    c = PreferenceDataset(
        nested,
        tok,
        max_length=64,
        prompt_key="extra_info.question",
        chosen_key="extra_info.good",
        rejected_key="extra_info.bad",
    ).pairs
    assert a == b == c and a[0][1][-1] == tok.eos_token_id and a[0][1] != a[0][2]


BAD_ROWS = [
    {"prompt": "q1", "chosen": "1", "rejected": "2"},
    {"prompt": "q2", "chosen": "", "rejected": "2"},
    {"prompt": "q3", "chosen": "3", "rejected": "   "},
    {"prompt": "q4", "chosen": "4", "rejected": "4"},
    {"prompt": "q5", "chosen": "5", "rejected": "6"},
]


def test_invalid_pairs_are_counted_and_dropped_or_refused(model_dir, tmp_path):
    tok, path = load_tokenizer(model_dir), _write(tmp_path, BAD_ROWS)
    data = PreferenceDataset(path, tok, max_length=64)
    assert len(data) == 2 and data.dropped == {"empty": 2, "identical": 1}
    with pytest.raises(ValueError, match=r"row 1: an empty chosen or rejected response.*data.invalid_pairs=drop"):
        PreferenceDataset(path, tok, max_length=64, invalid_pairs="error")
    identical = _write(tmp_path, [BAD_ROWS[0], BAD_ROWS[3]], "identical.parquet")
    with pytest.raises(ValueError, match="row 1: identical chosen and rejected"):
        PreferenceDataset(identical, tok, max_length=64, invalid_pairs="error")
    only_bad = _write(tmp_path, BAD_ROWS[1:4], "only_bad.parquet")
    with pytest.raises(ValueError, match="no valid preference pair left"):
        PreferenceDataset(only_bad, tok, max_length=64)


@pytest.mark.parametrize(
    "rows, kwargs, message",
    [
        ([{"prompt": "q", "chosen": "a"}], {}, r"column\(s\) \['rejected'\] missing.*data.chosen_key"),
        (
            [{"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}],
            {},
            "row 0: column 'chosen' must be a string or one assistant message",
        ),
        ([{"prompt": "q " * 80, "chosen": "a", "rejected": "b"}], {}, "exceed data.max_length=32.*data.truncation"),
        ([{"prompt": ["q"], "chosen": "a", "rejected": "b"}], {}, "row 0: the prompt must be a string or a list of"),
        ([{"prompt": None, "chosen": "a", "rejected": "b"}], {}, "row 0: no value at 'prompt'; set data.prompt_key"),
    ],
)
def test_bad_rows_name_the_file_row_and_fix(model_dir, tmp_path, rows, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PreferenceDataset(_write(tmp_path, rows), load_tokenizer(model_dir), max_length=32, **kwargs)


def test_truncation_keeps_pairs_within_max_length(model_dir, tmp_path):
    tok = load_tokenizer(model_dir)
    long_prompt = _write(tmp_path, [{"prompt": "q " * 80, "chosen": "a", "rejected": "b c d"}], "long_prompt.parquet")
    long_answer = _write(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b " * 80}], "long_answer.parquet")
    for mode, path in (("left", long_prompt), ("right", long_answer)):
        prompt, chosen, rejected = PreferenceDataset(path, tok, max_length=32, truncation=mode).pairs[0]
        assert len(prompt) + max(len(chosen), len(rejected)) == 32 and chosen and rejected, mode


def test_collate_puts_each_pair_on_two_adjacent_rows(model_dir, tmp_path):
    pairs = [([1, 2], [3], [4, 5]), ([6], [7, 8, 9], [10])]
    out = preference_collate(pairs, pad_token_id=0)
    resp, mask = out.batch[keys.RESPONSES], out.batch[keys.RESPONSE_MASK]
    assert resp.tolist() == [[3, 0, 0], [4, 5, 0], [7, 8, 9], [10, 0, 0]]
    assert mask.sum(-1).tolist() == [1, 2, 3, 1]
    assert out.batch[keys.INPUT_IDS][1].tolist()[:2] == [1, 2] and out.batch[keys.INPUT_IDS][3].tolist()[1] == 6


def test_sampled_wrong_answers_replace_the_rule_where_found(tmp_path):
    def sampler(rows):
        return ["I think it is 1000000" if i % 2 == 0 else None for i in range(len(rows))]

    train, _ = build_preference_task("arithmetic", tmp_path, 6, 2, seed=0, sampler=sampler)
    ruled, _ = build_preference_task("arithmetic", tmp_path / "rule", 6, 2, seed=0)
    frame, rule = pd.read_parquet(train), pd.read_parquet(ruled)
    assert frame["rejected_source"].tolist() == ["sampled", "rule"] * 3
    assert (frame["rejected"][::2] == "I think it is 1000000").all()
    assert frame["rejected"][1::2].tolist() == rule["rejected"][1::2].tolist()  # the rule's, as without a sampler
