"""LoRA on the FSDP2 engine (one gloo rank, tiny Llama): only adapters train, the reference is the base
model with adapters off, the rollout gets merged weights (later only the adapted layers'), checkpoints
hold the adapters alone and resume exactly, exports merge them or write a peft adapter directory.
The merge on two sharded or replicated ranks is checked in tests/test_engine_distributed.py."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridflow.cli import main as cli
from hybridflow.engine import CheckpointError, EngineConfig, FSDPEngine, LoraConfig, OptimConfig, export_hf
from hybridflow.engine.lora import apply_lora, is_adapter_key
from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir
from hybridflow.protocol import keys
from hybridflow.rollout import RolloutConfig, build_rollout, sync_weights
from tests.engine_helpers import full, make_batch

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
ADAPTED = {f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv"}


def _engine(lora: LoraConfig | None = LORA, dtype: str = "fp32") -> FSDPEngine:
    optim = OptimConfig(lr=1e-2, lr_warmup_steps_ratio=0.5, total_training_steps=4)
    return FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig(param_dtype=dtype), optim, lora=lora)


def _loss(out, micro):
    mask = micro[keys.ATTENTION_MASK][:, -micro[keys.RESPONSES].shape[1] :].float()
    return -(out["log_probs"] * mask).sum() / mask.sum(), {}


def _step(engine: FSDPEngine, seed: int) -> dict[str, float]:
    metrics = engine.train_step([make_batch(4, 6, 5, seed=seed)], _loss)
    engine.lr_scheduler_step()
    return metrics


def _weights(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: full(v).clone() for k, v in engine.module.state_dict().items()}


def _adapters(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _weights(engine).items() if is_adapter_key(k)}


def _peft_copy(adapters: dict[str, torch.Tensor]) -> peft.PeftModel:
    """A plain (unsharded) peft model with these adapters: what peft itself would merge."""
    model = apply_lora(load_causal_lm(tiny_model_dir("llama")), LORA)
    model.load_state_dict(adapters, strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    """A LoRA engine after two update steps, its first forward run with adapters off."""
    engine = _engine()
    with engine.adapters_disabled():  # FSDP2's first forward, with adapters off, must not freeze them
        engine.compute_log_probs(make_batch(4, 6, 5, seed=1), 2)
    before = _weights(engine)
    _step(engine, seed=2)
    _step(engine, seed=3)
    return engine, before


def test_only_the_adapters_train(trained):
    engine, before = trained
    after = _weights(engine)
    adapters = {k for k in after if is_adapter_key(k)}
    assert len(adapters) == 2 * len(ADAPTED)  # lora_A and lora_B per adapted projection
    assert {k for k in after if not torch.equal(after[k], before[k])} == adapters
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for n, p in engine.module.named_parameters() if is_adapter_key(n)}
    assert in_optimizer == trainable and all(p.requires_grad for p in engine.module.parameters() if id(p) in trainable)
    fresh = _adapters(_engine())  # every rank (and every run) starts from the same adapters
    assert all(torch.equal(fresh[k], before[k]) for k in adapters)


def test_bf16_update_after_a_first_forward_without_adapters():
    """FSDP2 picks the reduce dtype from the parameters trainable at its first forward (fp32 here)."""
    engine = _engine(dtype="bf16")
    with engine.adapters_disabled():
        engine.compute_log_probs(make_batch(4, 6, 5, seed=1), 2)
    before = _adapters(engine)
    assert _step(engine, seed=2)["update_skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in _adapters(engine).items())


@pytest.mark.parametrize(
    "targets, message",
    [
        (["embed_tokens"], "embed_tokens is of type Embedding; adapters are supported on linear layers only"),
        (["lm_head"], "lm_head shares its weight with another layer"),
        (["q_prj"], r"lora.target_modules=\['q_prj'\] does not fit LlamaForCausalLM"),
    ],
)
def test_adapters_the_merge_cannot_express_are_refused(targets, message):
    with pytest.raises(ValueError, match=message):
        apply_lora(load_causal_lm(tiny_model_dir("llama")), LoraConfig(rank=2, target_modules=targets))


def test_reference_is_the_base_model(trained):
    engine, _ = trained
    data = make_batch(5, 6, 5, seed=4)
    with engine.adapters_disabled():
        ref, _ = engine.compute_log_probs(data, 2)
    adapted, _ = engine.compute_log_probs(data, 2)
    base, _ = _engine(lora=None).compute_log_probs(data, 2)
    torch.testing.assert_close(ref, base, atol=1e-6, rtol=1e-6)
    assert (adapted - base).abs().max() > 1e-3
    with pytest.raises(RuntimeError, match="no adapters"):
        FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig()).adapters_disabled()
    with pytest.raises(ValueError, match="value model"):
        FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig(), value_model=True, lora=LORA)


def test_rollout_gets_the_merged_weights_and_later_only_the_adapted_layers(trained):
    engine, _ = trained
    path = tiny_model_dir("llama")
    rollout = build_rollout(RolloutConfig(name="native", dtype="fp32", response_length=4), path, load_tokenizer(path))
    sent: list[set[str]] = []
    load = rollout.load_weights
    rollout.load_weights = lambda state, partial=False: (sent.append(set(state)), load(state, partial))
    sync_weights(rollout, engine)
    _step(engine, seed=5)
    sync_weights(rollout, engine, changed_only=True)
    assert len(sent[0]) == len(rollout.model.state_dict()) and sent[1] == ADAPTED
    merged = _peft_copy(_adapters(engine)).merge_and_unload().state_dict()
    for key, value in rollout.model.state_dict().items():
        torch.testing.assert_close(value, merged[key], atol=1e-6, rtol=0, msg=key)
    assert rollout.model.lm_head.weight.data_ptr() == rollout.model.model.embed_tokens.weight.data_ptr()


def test_checkpoint_holds_only_the_adapters_and_resumes_exactly(tmp_path):
    first = _engine()
    _step(first, seed=2)
    first.save_checkpoint(tmp_path / "ckpt")
    expected = _step(first, seed=3)
    resumed = _engine()
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = _step(resumed, seed=3)
    assert (got["loss"], got["grad_norm"], got["lr"]) == (expected["loss"], expected["grad_norm"], expected["lr"])
    assert all(torch.equal(a, b) for a, b in zip(_weights(first).values(), _weights(resumed).values()))
    saved = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert len(model_keys) == 2 * len(ADAPTED) and all(is_adapter_key(k) for k in model_keys)
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["lora"]["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(CheckpointError, match="LoRA settings"):
        _engine(lora=None).load_checkpoint(tmp_path / "ckpt")


def _logits(model, data):
    with torch.no_grad():
        return model(
            input_ids=data[keys.INPUT_IDS],
            attention_mask=data[keys.ATTENTION_MASK],
            position_ids=data[keys.POSITION_IDS],
        ).logits


def test_merged_and_adapter_exports_give_the_adapted_model(trained, tmp_path):
    engine, _ = trained
    step = tmp_path / "run" / "global_step_2"
    engine.save_checkpoint(step / "actor")
    (step / "trainer_state.json").write_text(json.dumps({"model_path": str(tiny_model_dir("llama"))}))
    assert cli.main(["export", str(step), "--out", str(tmp_path / "merged")]) == 0
    assert cli.main(["export", str(step), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    data = make_batch(3, 6, 5, seed=6)
    expected = _logits(_peft_copy(_adapters(engine)), data)
    merged = _logits(load_causal_lm(tmp_path / "merged"), data)
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    adapter = peft.PeftModel.from_pretrained(load_causal_lm(tiny_model_dir("llama")), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(adapter, data), expected, atol=0, rtol=0)
    lp, _ = engine.compute_log_probs(data, 3)
    ref = torch.log_softmax(merged[:, -6:-1], -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    mask = data[keys.ATTENTION_MASK][:, -5:].bool()
    torch.testing.assert_close(lp[mask], ref[mask], atol=2e-5, rtol=1e-5)
    with pytest.raises(CheckpointError, match="base model"):
        export_hf(step / "actor", tmp_path / "nobase")
    export_hf(engine, tmp_path / "from_engine")  # what the worker's export_hf does: merged too
    torch.testing.assert_close(_logits(load_causal_lm(tmp_path / "from_engine"), data), merged, atol=0, rtol=0)
