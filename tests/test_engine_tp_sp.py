"""Tensor parallel x Ulysses sequence parallel (tp 2 x sp 2 on 4 gloo ranks, one engine: engine/parallel/parallelize.py)
computes what one plain process computes: log-probs and entropy, values, the loss, gradients and one AdamW
step, on tiny Llama and Qwen2 models whose 8 heads / 4 kv heads leave each tp rank 2 kv heads to split over sp,
and on a Llama with 2 kv heads, whose one kv head per tp rank is repeated for the q heads each sp rank holds.
Llama runs FSDP sharded over the dp x sp ranks (fsdp_size -1), Qwen2 replicated over them (fsdp_size 1); the
checkpoint restores into one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engine.parallel.sequence_parallel import check_sp_layout
from hybridflow.models import tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import free_port, make_group_batch, policy_nll_loss
from tests.test_engine_sequence_parallel import OPTIM, ROWS, R, _reference, _value_loss

MODEL = dict(hidden_size=64, num_heads=8, num_kv_heads=4)


def _data() -> dict[str, torch.Tensor]:
    return make_group_batch(4, 2, 12, R, seed=3)


def _micro(shard: dict, size: int = 2) -> list[dict]:
    return [{k: v[i : i + size] for k, v in shard.items()} for i in range(0, ROWS, size)]


def _worker(rank: int, world: int, arch: str, fsdp_size: int, kv: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    path, data = tiny_model_dir(arch, **{**MODEL, "num_kv_heads": kv}), _data()
    cfg = EngineConfig(
        param_dtype="fp32", tensor_parallel_size=2, ulysses_sequence_parallel_size=2, fsdp_size=fsdp_size
    )
    engine = FSDPEngine.from_pretrained(path, cfg, OptimConfig(**OPTIM))
    q_proj = engine.module.model.layers[0].self_attn.q_proj.weight
    res: dict = {"coords": (engine.dp_rank, engine.sp_rank, engine.tp_rank), "q_rows": q_proj.to_local().shape[0]}
    res["log_probs"], res["entropy"] = engine.compute_log_probs(data, 2, calc_entropy=True)
    tokens = int(data[keys.ATTENTION_MASK][:, -R:].sum())
    loss_fn = policy_nll_loss(tokens, engine.dp_size, R)
    res["loss"] = 0.0
    for micro in _micro(data):
        loss, _ = loss_fn(engine.forward_micro_batch(micro), micro)
        loss.backward()
        res["loss"] += float(loss.detach())
    res["grads"] = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    res["metrics"] = engine.train_step(_micro(data), loss_fn)
    res["trained"] = engine.full_state_dict()
    engine.save_checkpoint(Path(out_dir) / "ckpt")
    torch.manual_seed(0)  # the value head starts random: the same on every rank and in the reference
    critic = FSDPEngine.from_pretrained(path, cfg, OptimConfig(**OPTIM), value_model=True)
    res["values"] = critic.compute_values(data, 4)
    res["critic"] = critic.train_step(_micro(data), _value_loss(tokens, critic.dp_size))
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda details: f"{msg}: {details}")


def _close_after_step(got: torch.Tensor, want: torch.Tensor, grad: torch.Tensor | None, msg: str) -> None:
    """Weights after one AdamW step. Its first update is lr * g / (|g| + eps): where |g| is within a few
    dozen eps, float noise in g (the order of reductions differs) moves the update by a fraction of lr, so
    those elements are held to lr (qwen2: one element of o_proj, |g| = 1.9e-7)."""
    steady = torch.ones_like(want, dtype=torch.bool) if grad is None else grad.abs() > 1e-6
    _close(got[steady], want[steady], msg)
    assert (got - want).abs().max() <= OPTIM["lr"], msg


@pytest.mark.slow  # 4 gloo processes, 30-85 s each on 2 CPU cores; .ci/run runs the slow set
@pytest.mark.parametrize(("arch", "fsdp_size", "kv"), [("llama", -1, 4), ("qwen2", 1, 4), ("llama", -1, 2)])
def test_tp2_sp2_matches_one_process(tmp_path, arch, fsdp_size, kv):
    path = tiny_model_dir(arch, **{**MODEL, "num_kv_heads": kv})  # build the cache once, before the workers race
    mp.spawn(_worker, args=(4, arch, fsdp_size, kv, free_port(), str(tmp_path)), nprocs=4, join=True)
    data, ranks = _data(), [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    ref = _reference(path, data)
    assert [r["coords"] for r in ranks] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]  # rank = sp * 2 + tp
    shards = 2 * (2 if fsdp_size == -1 else 1)
    assert all(r["q_rows"] == MODEL["hidden_size"] // shards for r in ranks)  # q_proj split over tp (and dp x sp)
    for r in ranks:
        _close(r["log_probs"], ref["log_probs"], "log_probs")
        _close(r["entropy"], ref["entropy"], "entropy")
        _close(r["values"], ref["values"], "values")
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["metrics"]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert r["critic"]["grad_norm"] == pytest.approx(ref["critic_norm"], rel=1e-4)
        for name, g in ref["grads"].items():
            _close(r["grads"][name], g, f"grad {name}")
        for name, w in ref["trained"].items():
            _close_after_step(r["trained"][name], w, ref["grads"].get(name), f"trained {name}")
    # the tp x sp checkpoint restores into one process without either
    one = FSDPEngine.from_pretrained(path, EngineConfig(param_dtype="fp32"), OptimConfig(**OPTIM))
    one.load_checkpoint(tmp_path / "ckpt")
    for name, w in one.full_state_dict().items():
        torch.testing.assert_close(w, ranks[0]["trained"][name], atol=0, rtol=0, msg=name)


def test_sp_is_bounded_by_the_heads_of_a_tp_rank():
    check_sp_layout(2, 4, 8, 4, tp=2)  # 2 kv heads per tp rank: one per sp rank
    check_sp_layout(2, 4, 4, 2, tp=2)  # 1 kv head per tp rank: its copies split over the sp ranks
    check_sp_layout(3, 9, 9, 3, tp=3)  # SmolLM2 at tp 3 x sp 3
    with pytest.raises(
        ValueError,
        match=r"=4 must be at most num_attention_heads \(4\) / tensor_parallel_size \(2\) = 2: each sp rank",
    ):
        check_sp_layout(4, 8, 4, 2, tp=2)
