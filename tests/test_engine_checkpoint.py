"""Checkpoints in one process: interrupted saves are never loaded; HF export reproduces the logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.engine import CheckpointError, EngineConfig, FSDPEngine, OptimConfig, export_hf, latest_checkpoint
from hybridflow.models import load_tokenizer, load_value_model, tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import make_batch


def _trained_engine(value_model: bool = False) -> FSDPEngine:
    engine = FSDPEngine.from_pretrained(
        tiny_model_dir("llama"), EngineConfig(param_dtype="fp32"), OptimConfig(lr=1e-2), value_model=value_model
    )
    data = make_batch(2, 6, 4, seed=8)
    key = "values" if value_model else "log_probs"
    engine.train_step([data], lambda out, micro: (-out[key].sum(), {}))
    return engine


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("simulated crash in the middle of a save")


def test_interrupted_save_is_never_loaded(tmp_path):
    engine = _trained_engine()
    good = engine.save_checkpoint(tmp_path / "global_step_1", extra={"step": 1})
    with pytest.raises(RuntimeError, match="simulated crash"):
        engine.save_checkpoint(tmp_path / "global_step_2", extra={"bad": _Unpicklable()})
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("global_step_2")]
    assert leftovers and all(".tmp-" in p.name for p in leftovers)  # shards written, never renamed
    (tmp_path / "global_step_3").mkdir()  # a directory without the COMPLETE marker
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        engine.load_checkpoint(leftovers[0])
    assert engine.load_checkpoint(good) == {"step": 1}
    assert latest_checkpoint(tmp_path / "missing") is None


def _hf_logits(path, data):
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(
            input_ids=data[keys.INPUT_IDS],
            attention_mask=data[keys.ATTENTION_MASK],
            position_ids=data[keys.POSITION_IDS],
        ).logits


def test_export_hf_from_engine_and_from_checkpoint(tmp_path):
    engine = _trained_engine()
    data = make_batch(3, 6, 5, seed=9)
    lp, _ = engine.compute_log_probs(data, 3)
    export_hf(engine, tmp_path / "from_engine", load_tokenizer(tiny_model_dir("llama")))
    engine.save_checkpoint(tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "from_ckpt", tiny_model_dir("llama"))
    logits = _hf_logits(tmp_path / "from_engine", data)
    torch.testing.assert_close(_hf_logits(tmp_path / "from_ckpt", data), logits, atol=0, rtol=0)
    ref = torch.log_softmax(logits[:, -6:-1], -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    mask = data[keys.ATTENTION_MASK][:, -5:].bool()
    torch.testing.assert_close(lp[mask], ref[mask], atol=2e-5, rtol=1e-5)
    assert AutoTokenizer.from_pretrained(tmp_path / "from_ckpt").chat_template


def test_value_model_export_reloads_with_its_head(tmp_path):
    engine = _trained_engine(value_model=True)
    data = make_batch(3, 6, 5, seed=10)
    values = engine.compute_values(data, 3)
    engine.save_checkpoint(tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "critic", None)
    reloaded = FSDPEngine(load_value_model(tmp_path / "critic"), EngineConfig(param_dtype="fp32"))
    torch.testing.assert_close(reloaded.compute_values(data, 3), values, atol=1e-6, rtol=1e-5)
