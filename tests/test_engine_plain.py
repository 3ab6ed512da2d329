"""One rank computing in the weights' own dtype runs the plain module, without FSDP2 (engine/parallel/parallelize.py
`needs_fsdp`): it trains bit-identically to the FSDP2-wrapped module, and checkpoints move between the two."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engine.parallel import parallelize as parallelize_module
from hybridflow.models import tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import full, make_batch


def _engine(monkeypatch: pytest.MonkeyPatch, fsdp: bool | None = None, dtype: str = "fp32") -> FSDPEngine:
    """An actor engine on the tiny Llama; fsdp=True/False forces the wrapping, None leaves the choice to the engine."""
    with monkeypatch.context() as m:
        if fsdp is not None:
            m.setattr(parallelize_module, "needs_fsdp", lambda *a: fsdp)
        torch.manual_seed(0)
        return FSDPEngine.from_pretrained(
            tiny_model_dir("llama"), EngineConfig(param_dtype=dtype), OptimConfig(lr=1e-2, grad_clip=0.5)
        )


def _data(seed: int) -> dict:
    data = make_batch(4, 6, 5, seed=seed)
    data[keys.RESPONSE_MASK] = data[keys.ATTENTION_MASK][:, -5:]
    return data


def _loss(out: dict, micro: dict) -> tuple[torch.Tensor, dict]:
    return -(out["log_probs"] * micro[keys.RESPONSE_MASK]).sum(), {}


def _train(engine: FSDPEngine, seeds: list[int]) -> list[float]:
    """One step per seed, each over two micro-batches (gradients accumulate across them)."""
    norms = []
    for seed in seeds:
        data = _data(seed)
        micros = [{k: v[:2] for k, v in data.items()}, {k: v[2:] for k, v in data.items()}]
        norms.append(engine.train_step(micros, _loss)["grad_norm"])
    return norms


def test_fsdp2_only_where_it_shards_or_casts(monkeypatch):
    plain = _engine(monkeypatch)
    assert not isinstance(plain.model, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    assert isinstance(_engine(monkeypatch, dtype="bf16").model, FSDPModule)  # casts the fp32 master weights


def test_plain_module_trains_bit_identically_to_fsdp2(monkeypatch):
    plain, wrapped = _engine(monkeypatch), _engine(monkeypatch, fsdp=True)
    assert isinstance(wrapped.model, FSDPModule)
    assert _train(plain, [1, 2, 3]) == _train(wrapped, [1, 2, 3])
    for a, b in zip(plain.model.parameters(), wrapped.model.parameters(), strict=True):
        torch.testing.assert_close(a, full(b), rtol=0, atol=0)
    data = _data(9)
    lp_plain, ent_plain = plain.compute_log_probs(data, 2, calc_entropy=True)
    lp_wrapped, ent_wrapped = wrapped.compute_log_probs(data, 2, calc_entropy=True)
    torch.testing.assert_close(lp_plain, lp_wrapped, rtol=0, atol=0)
    torch.testing.assert_close(ent_plain, ent_wrapped, rtol=0, atol=0)


@pytest.mark.parametrize("save_fsdp", [True, False])
def test_checkpoints_move_between_plain_and_fsdp2(monkeypatch, tmp_path, save_fsdp):
    saver = _engine(monkeypatch, fsdp=save_fsdp)
    _train(saver, [1])
    saver.save_checkpoint(tmp_path / "ckpt", extra={"step": 1})
    loader = _engine(monkeypatch, fsdp=not save_fsdp)
    assert loader.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    for a, b in zip(saver.model.parameters(), loader.model.parameters(), strict=True):
        torch.testing.assert_close(full(a), full(b), rtol=0, atol=0)
    # the optimizer's moments came across too: the next step is the same on both
    assert _train(saver, [2]) == _train(loader, [2])
    for a, b in zip(saver.model.parameters(), loader.model.parameters(), strict=True):
        torch.testing.assert_close(full(a), full(b), rtol=0, atol=0)
