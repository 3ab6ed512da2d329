"""Reward models: trained heads survive loading, the worker scores like transformers, bad dirs are refused.

The reference scores come from transformers' own `*ForSequenceClassification`
forward on each row's unpadded sequence, independent of hybridflow's engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    LlamaForSequenceClassification,
)

from hybridflow.controller.local import LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.models import load_value_model, tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.workers import ModelConfig, RewardModelConfig, RewardModelWorker
from hybridflow.workers.reward_model import last_token_scores, score_inputs

PROMPT_LENS = (3, 6, 1, 4, 5)
RESPONSE_LENS = (5, 2, 1, 0, 3)  # row 0 fills the response width, row 3 is empty
P, R = max(PROMPT_LENS), max(RESPONSE_LENS)


def _seeded_head(head: torch.nn.Linear, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.5)
    return head.weight.detach().clone()


def _llama_reward_model_dir(out: Path, num_labels: int = 1) -> Path:
    """The tiny Llama as a LlamaForSequenceClassification with a seeded head, plus its tokenizer."""
    src = tiny_model_dir("llama")
    model = LlamaForSequenceClassification.from_pretrained(src, num_labels=num_labels, dtype=torch.float32)
    _seeded_head(model.score, seed=7)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses with the lengths above (keys.py layout)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(PROMPT_LENS), P + R), generator=g)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        mask[i, P - p : P + r] = 1
    return {
        K.INPUT_IDS: ids,
        K.ATTENTION_MASK: mask,
        K.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
        K.RESPONSES: ids[:, P:],
        K.RESPONSE_MASK: mask[:, P:],
    }


def _reference_scores(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[float]:
    """transformers' sequence score of every row, computed on the row's unpadded tokens alone."""
    model.config.pad_token_id = None  # batch of one: pool at the last token whatever its id
    model.eval()
    out = []
    with torch.no_grad():
        for ids, mask in zip(batch[K.INPUT_IDS], batch[K.ATTENTION_MASK]):
            out.append(float(model(input_ids=ids[mask.bool()][None]).logits[0, 0]))
    return out


def _rm_group(path: Path, **cfg) -> LocalWorkerGroup:
    config = RewardModelConfig(enable=True, model=ModelConfig(path=str(path)), **cfg)
    return LocalWorkerGroup(None, ClassWithInitArgs(RewardModelWorker, config))


def test_worker_scores_equal_transformers_sequence_classifier(tmp_path):
    rm_dir = _llama_reward_model_dir(tmp_path / "rm")
    batch = _batch(vocab=49152)
    group = _rm_group(rm_dir, param_dtype="fp32", micro_batch_size_per_device=3)  # 2 micro-batches
    group.init_model()
    scores = group.compute_rm_score(DataProto.from_dict(batch)).batch[K.RM_SCORES]
    ref = LlamaForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    expected = torch.zeros(len(PROMPT_LENS), R)
    for i, (score, r) in enumerate(zip(_reference_scores(ref, batch), RESPONSE_LENS)):
        if r > 0:
            expected[i, r - 1] = score
    assert scores.shape == (len(PROMPT_LENS), R) and scores.dtype == torch.float32
    assert torch.count_nonzero(scores).item() == sum(r > 0 for r in RESPONSE_LENS)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)
    assert expected.abs().max() > 0.1  # the seeded head gives scores far from 0


def test_causal_lm_as_reward_model_is_refused_with_the_fix():
    group = _rm_group(tiny_model_dir("llama"))
    with pytest.raises(
        ValueError,
        match=r"reward_model\.model\.path=.*LlamaForCausalLM.*no trained score head"
        r".*ForSequenceClassification or \*ForTokenClassification.*num_labels=1",
    ):
        group.init_model()


def test_two_label_classifier_is_refused(tmp_path):
    rm_dir = _llama_reward_model_dir(tmp_path / "rm2", num_labels=2)
    with pytest.raises(ValueError, match=r"reward_model\.model\.path=.*num_labels=2"):
        _rm_group(rm_dir).init_model()
    with pytest.raises(ValueError, match=r"num_labels=2.*exactly one label"):
        load_value_model(rm_dir)


def test_score_inputs_put_the_last_token_output_in_column_length():
    batch = _batch(vocab=100)
    inputs = score_inputs(batch)
    assert inputs[K.INPUT_IDS].shape == (len(PROMPT_LENS), P + R + 1)
    dummy = inputs[K.ATTENTION_MASK][:, P:].sum(-1) - batch[K.RESPONSE_MASK].sum(-1)
    assert dummy.tolist() == [1] * len(PROMPT_LENS)  # exactly one extra real token per row
    for i, r in enumerate(RESPONSE_LENS):
        assert inputs[K.ATTENTION_MASK][i, P + r] == 1  # right after the response
    values = torch.arange(R + 1, dtype=torch.float32).repeat(len(PROMPT_LENS), 1) + 10
    scores = last_token_scores(values, batch[K.RESPONSE_MASK])
    for i, r in enumerate(RESPONSE_LENS):
        assert scores[i].tolist() == [10.0 + r if j == r - 1 else 0.0 for j in range(R)]


def test_llama_sequence_classifier_keeps_its_head_as_value_model(tmp_path):
    rm_dir = _llama_reward_model_dir(tmp_path / "rm")
    head = LlamaForSequenceClassification.from_pretrained(rm_dir).score.weight
    critic = load_value_model(rm_dir)
    torch.testing.assert_close(critic.backbone.score.weight, head)
    assert torch.count_nonzero(critic.backbone.score.bias) == 0


def _gpt2_config(**kw) -> GPT2Config:
    return GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        **kw,
    )


def test_gpt2_causal_lm_loads_as_value_model_with_fresh_classifier(tmp_path):
    torch.manual_seed(0)
    GPT2LMHeadModel(_gpt2_config()).save_pretrained(tmp_path / "gpt2")
    critic = load_value_model(tmp_path / "gpt2")
    ids = torch.randint(0, 128, (3, 7))
    values = critic(ids, torch.ones_like(ids))
    assert values.shape == (3, 7) and values.dtype == torch.float32 and torch.isfinite(values).all()
    head = critic.backbone.classifier
    assert torch.count_nonzero(head.bias) == 0 and head.weight.std() < 0.05  # small, fresh
    critic.save_pretrained(tmp_path / "critic")  # a saved GPT-2 value model restores everything
    torch.testing.assert_close(load_value_model(tmp_path / "critic")(ids, torch.ones_like(ids)), values)


def test_gpt2_sequence_classifier_head_moves_to_the_token_classifier(tmp_path):
    torch.manual_seed(0)
    rm = GPT2ForSequenceClassification(_gpt2_config(num_labels=1))
    _seeded_head(rm.score, seed=3)
    rm.save_pretrained(tmp_path / "rm")
    critic = load_value_model(tmp_path / "rm")
    assert isinstance(critic.backbone, GPT2ForTokenClassification)
    torch.testing.assert_close(critic.backbone.classifier.weight, rm.score.weight)
    assert torch.count_nonzero(critic.backbone.classifier.bias) == 0
    ids = torch.randint(2, 128, (2, 6))  # no pad id (0): the classifier pools at the last token
    values = critic(ids, torch.ones_like(ids))
    rm.eval()
    with torch.no_grad():  # the value at position t is the score of the prefix ending at t
        for t in (2, 5):
            torch.testing.assert_close(values[:, t], rm(input_ids=ids[:, : t + 1]).logits[:, 0])


def test_remax_baseline_includes_the_reward_model_score():
    """ReMax's greedy baseline is scored like the samples: rule score + reward-model score."""
    from types import SimpleNamespace

    from hybridflow.config.trainer import AlgorithmConfig
    from hybridflow.rollout.config import SamplingParams
    from hybridflow.train.core_steps import reward_baselines

    calls = []

    class Policy:
        def generate_sequences(self, prompts, **kwargs):
            calls.append(kwargs)
            return DataProto.from_dict({"responses": torch.zeros(len(prompts), 3, dtype=torch.long)})

    class RM:
        def compute_rm_score(self, data):
            return DataProto.from_dict({K.RM_SCORES: torch.tensor([[0.0, 0.0, 2.0], [0.0, -1.0, 0.0]])})

    def reward_fn(data):  # rule score 0.5 at the last token, plus rm_scores as the RewardManager adds them
        rule = torch.zeros(len(data), 3)
        rule[:, -1] = 0.5
        return SimpleNamespace(token_level_scores=rule + data.batch[K.RM_SCORES])

    prompts = DataProto.from_dict({"input_ids": torch.ones(2, 4, dtype=torch.long)}, meta_info={K.META_GLOBAL_STEP: 7})
    roles = SimpleNamespace(actor_rollout=Policy(), reward_model=RM())
    sampling = SamplingParams(temperature=0.7, n=3)
    base = reward_baselines(AlgorithmConfig(adv_estimator="remax"), roles, prompts, reward_fn, sampling)
    assert base.tolist() == [2.5, 2.5, 2.5, -0.5, -0.5, -0.5]
    assert calls == [{"step": 7, "sampling": SamplingParams(temperature=0.7, do_sample=False, n=1)}]
