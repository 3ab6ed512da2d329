"""On CPU with one rank per shard group the engine frees each layer's gathered weights after forward
(`reshard_after_forward` resolves to True there): FSDP2 gathers into a copy even on one rank. bf16 compute
keeps FSDP2 on one rank (it casts the fp32 master weights); in fp32 one rank runs the plain module
(tests/test_engine_plain.py)."""

import torch

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.models import tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import make_batch


def _engine(**kw) -> FSDPEngine:
    torch.manual_seed(0)
    return FSDPEngine.from_pretrained(
        tiny_model_dir("llama"), EngineConfig(param_dtype="bf16", **kw), OptimConfig(lr=1e-2)
    )


def _layers_sharded_before_the_head(engine: FSDPEngine, data: dict) -> list[bool]:
    """Whether each decoder layer holds only its shard when the forward reaches the final norm."""
    layers = [m for name, m in engine.model.named_modules() if name.rsplit(".", 2)[-2:-1] == ["layers"]]
    seen: list[bool] = []

    def record(_module, _args) -> None:
        seen.extend(layer._get_fsdp_state()._fsdp_param_group.is_sharded for layer in layers)

    norm = next(m for name, m in engine.model.named_modules() if name.endswith("model.norm"))
    handle = norm.register_forward_pre_hook(record)
    try:
        engine.train_step([data], lambda out, micro: (-(out["log_probs"] * micro[keys.RESPONSE_MASK]).sum(), {}))
    finally:
        handle.remove()
    return seen


def test_one_rank_frees_gathered_layers_after_forward_and_trains_the_same():
    data = make_batch(3, 6, 5, seed=7)
    data[keys.RESPONSE_MASK] = data[keys.ATTENTION_MASK][:, -5:]
    freed, kept = _engine(), _engine(reshard_after_forward=False)
    freed_states = _layers_sharded_before_the_head(freed, data)
    kept_states = _layers_sharded_before_the_head(kept, data)
    assert freed_states and all(freed_states)
    assert kept_states and not any(kept_states)
    for a, b in zip(freed.model.parameters(), kept.model.parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0)
