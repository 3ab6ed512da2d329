"""Weight sync: a full fp32 state dict loaded into a rollout changes its outputs to the new model's."""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_helpers import prompt_batch, tiny
from torch.distributed.tensor import DTensor

from hybridflow.engine import EngineConfig, FSDPEngine
from hybridflow.protocol.keys import RESPONSES
from hybridflow.rollout import RolloutConfig, build_rollout, sync_weights


def _local(p: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a parameter: FSDP2's shard, or the parameter itself where a one-rank engine
    computing in its weights' dtype trains without FSDP2 (EngineConfig's auto dtype is fp32 where the probe
    finds bf16 slow)."""
    return p.to_local() if isinstance(p, DTensor) else p


def greedy_cfg(dtype: str = "fp32") -> RolloutConfig:
    return RolloutConfig(name="native", dtype=dtype, do_sample=False, response_length=8)


def test_load_weights_makes_outputs_match_the_new_model():
    old, tok = tiny("llama", seed=0)
    new, _ = tiny("llama", seed=1)
    rollout = build_rollout(greedy_cfg(), old, tok)
    before = rollout.generate_sequences(prompt_batch(tok)).batch[RESPONSES]
    expect = build_rollout(greedy_cfg(), new, tok).generate_sequences(prompt_batch(tok)).batch[RESPONSES]
    assert not torch.equal(before, expect)
    engine = FSDPEngine(copy.deepcopy(new), EngineConfig())  # one-rank FSDP2, fp32 master weights
    report = sync_weights(rollout, engine, check=True, share=False)  # gathers in the rollout's fp32
    assert report.seconds >= 0.0 and report.check_seconds > 0.0 and report.findings == [] and not report.shared
    assert torch.equal(rollout.generate_sequences(prompt_batch(tok)).batch[RESPONSES], expect)
    assert rollout.model.lm_head.weight.data_ptr() == rollout.model.model.embed_tokens.weight.data_ptr()


def test_a_one_rank_engine_in_the_rollouts_dtype_shares_its_tensors_with_the_rollout():
    """No copy: the rollout generates with the engine's own storage, so an optimizer step reaches it at once."""
    old, tok = tiny("llama", seed=0)
    new, _ = tiny("llama", seed=1)
    rollout = build_rollout(greedy_cfg(), old, tok)
    engine = FSDPEngine(copy.deepcopy(new), EngineConfig())
    report = sync_weights(rollout, engine, check=True)
    assert report.shared and report.findings == [] and report.check_seconds == 0.0
    expect = build_rollout(greedy_cfg(), new, tok).generate_sequences(prompt_batch(tok)).batch[RESPONSES]
    assert torch.equal(rollout.generate_sequences(prompt_batch(tok)).batch[RESPONSES], expect)
    engine_params = dict(engine.module.named_parameters(remove_duplicate=False))
    for name, p in rollout.model.named_parameters(remove_duplicate=False):
        assert p.data_ptr() == _local(engine_params[name]).data_ptr(), name
    with torch.no_grad():  # what an optimizer step does: in place
        _local(engine_params["model.embed_tokens.weight"]).mul_(0.5)
    assert torch.equal(rollout.model.model.embed_tokens.weight, _local(engine_params["model.embed_tokens.weight"]))
    assert torch.equal(rollout.model.lm_head.weight, rollout.model.model.embed_tokens.weight)


def test_a_rollout_in_another_dtype_is_copied_not_shared():
    from hybridflow.models import tiny_model_dir

    tok = tiny("llama")[1]
    rollout = build_rollout(greedy_cfg("bf16"), tiny_model_dir("llama", seed=0), tok)
    engine = FSDPEngine(tiny("llama", seed=1)[0], EngineConfig())
    assert not sync_weights(rollout, engine).shared
    assert rollout.model.lm_head.weight.dtype == torch.bfloat16


def test_fp32_state_dict_is_cast_into_a_bf16_rollout_and_tied_name_may_be_absent():
    from hybridflow.models import tiny_model_dir

    tok = tiny("llama")[1]
    rollout = build_rollout(greedy_cfg("bf16"), tiny_model_dir("llama", seed=0), tok)
    new, _ = tiny("llama", seed=1)
    state = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}
    rollout.load_weights(state)
    for key, value in state.items():
        assert torch.equal(rollout.model.state_dict()[key], value.to(torch.bfloat16)), key
    assert torch.equal(rollout.model.lm_head.weight, state["model.embed_tokens.weight"].to(torch.bfloat16))


def test_engine_gathers_in_the_rollout_dtype():
    """A bf16 rollout gets a bf16 gather equal to casting the fp32 master weights (half the traffic)."""
    from hybridflow.models import tiny_model_dir

    tok = tiny("llama")[1]
    rollout = build_rollout(greedy_cfg("bf16"), tiny_model_dir("llama", seed=0), tok)
    assert rollout.weight_dtype == torch.bfloat16
    new, _ = tiny("llama", seed=1)
    engine = FSDPEngine(copy.deepcopy(new), EngineConfig())
    gathered = engine.full_state_dict(dtype=torch.bfloat16)
    master = engine.full_state_dict()
    assert {v.dtype for v in gathered.values()} == {torch.bfloat16}
    assert {v.dtype for v in master.values()} == {torch.float32}
    for key, value in master.items():
        assert torch.equal(gathered[key], value.to(torch.bfloat16)), key
    sync_weights(rollout, engine)
    for key, value in rollout.model.state_dict().items():
        assert torch.equal(value, master[key].to(torch.bfloat16)), key


def test_partial_state_dict_replaces_only_its_weights_and_keeps_the_tied_ones():
    rollout = build_rollout(greedy_cfg("bf16"), tiny("llama", seed=0)[0].to(torch.bfloat16), tiny("llama")[1])
    before = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    new = tiny("llama", seed=1)[0].state_dict()
    part = {k: v for k, v in new.items() if k.endswith(("q_proj.weight", "v_proj.weight"))}
    rollout.load_weights(part, partial=True)
    for key, value in rollout.model.state_dict().items():
        assert torch.equal(value, part[key].to(torch.bfloat16) if key in part else before[key]), key
    assert rollout.model.lm_head.weight.data_ptr() == rollout.model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(KeyError, match="not in the rollout model"):
        rollout.load_weights(
            {"model.layers.0.q_proj.weight": part["model.layers.0.self_attn.q_proj.weight"]}, partial=True
        )


def test_bad_state_dicts_are_rejected():
    model, tok = tiny("llama")
    rollout = build_rollout(greedy_cfg(), model, tok)
    state = model.state_dict()
    with pytest.raises(KeyError, match="not in the rollout model"):
        rollout.load_weights({"_orig_mod." + k: v for k, v in state.items()})
    with pytest.raises(KeyError, match="lacks"):
        rollout.load_weights({k: v for k, v in state.items() if "layers.1." not in k})
    with pytest.raises(ValueError, match="shape"):
        rollout.load_weights({**state, "model.norm.weight": torch.ones(3)})
