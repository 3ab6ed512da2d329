"""Tensor parallel x FSDP2 on gloo ranks computes what one plain process computes: log-probs (padded,
packed, shared-prompt and token-budget micro-batches), values, loss, gradients, one optimizer step; a
tp=2 checkpoint restores into a one-process engine (weights and optimizer state) and into plain FSDP over
the same ranks, and exports to HF from the engine and from the checkpoint."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig, export_hf
from hybridflow.engine.batch import TokenBudget
from hybridflow.engine.parallel.tensor_parallel import check_tp_layout
from hybridflow.engine.prefix import sharing_pays
from hybridflow.models import default_model_dir, load_causal_lm, load_value_model, tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import (
    check_smollm2_one_step,
    free_port,
    make_group_batch,
    policy_nll_loss,
    reference_log_probs,
)

PROMPTS, N, P, R = 4, 2, 12, 5
ROWS = PROMPTS * N
OPTIM = dict(lr=1e-3, weight_decay=0.01, grad_clip=0.5)


def _data() -> dict[str, torch.Tensor]:
    return make_group_batch(PROMPTS, N, P, R, seed=3)


def _micro(shard: dict, size: int = 2) -> list[dict]:
    rows = shard[keys.INPUT_IDS].shape[0]
    return [{k: v[i : i + size] for k, v in shard.items()} for i in range(0, rows, size)]


def _worker(rank: int, world: int, tp: int, arch: str, port: int, out_dir: str, full: bool, fsdp_size: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    out, data = Path(out_dir), _data()
    cfg = EngineConfig(param_dtype="fp32", tensor_parallel_size=tp, fsdp_size=fsdp_size)
    engine = FSDPEngine.from_pretrained(tiny_model_dir(arch), cfg, OptimConfig(**OPTIM))
    dp, rows = engine.dp_size, ROWS // engine.dp_size
    shard = {k: v[engine.dp_rank * rows : (engine.dp_rank + 1) * rows] for k, v in data.items()}
    q_proj = engine.module.model.layers[0].self_attn.q_proj.weight
    res: dict = {"dp_rank": engine.dp_rank, "tp_rank": engine.tp_rank, "q_rows": q_proj.to_local().shape[0]}
    res["log_probs"], res["entropy"] = engine.compute_log_probs(shard, 2, calc_entropy=True)
    res["shared_pays"] = any(sharing_pays(m, engine.model.config) for m in _micro(shard))
    if full:
        res["budget"], _ = engine.compute_log_probs(shard, TokenBudget(30))
        engine.config = replace(cfg, share_prompts=False)
        res["padded"], _ = engine.compute_log_probs(shard, 2)
        engine.config = replace(cfg, packing=True)
        res["packed"], _ = engine.compute_log_probs(shard, 2)
        engine.config = cfg
        torch.manual_seed(0)  # the value head starts random: the same on every rank and in the reference
        critic = FSDPEngine.from_pretrained(tiny_model_dir(arch), cfg, value_model=True)
        res["values"] = critic.compute_values(shard, 2)
    loss_fn = policy_nll_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), dp, R)
    if full:
        res["loss"] = 0.0
        for micro in _micro(shard):
            loss, _ = loss_fn(engine.forward_micro_batch(micro), micro)
            loss.backward()
            res["loss"] += float(loss)
        res["grads"] = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
        engine.optimizer.zero_grad(set_to_none=True)
    res["metrics"] = engine.train_step(_micro(shard), loss_fn)
    res["trained"] = engine.full_state_dict()
    if full:
        _save_and_continue(engine, shard, loss_fn, out, res)
    torch.save(res, out / f"rank{rank}.pt")


def _save_and_continue(engine: FSDPEngine, shard: dict, loss_fn, out: Path, res: dict) -> None:
    engine.save_checkpoint(out / "ckpt")
    export_hf(engine, out / "hf")
    engine.train_step(_micro(shard), loss_fn)
    res["continued"] = engine.full_state_dict()
    # the same checkpoint into plain FSDP over all these ranks (tp 1, dp = world, parameters sharded)
    dp_only = FSDPEngine.from_pretrained(
        tiny_model_dir(engine.model.config.model_type),
        EngineConfig(param_dtype="fp32", fsdp_size=-1),
        OptimConfig(**OPTIM),
    )
    dp_only.load_checkpoint(out / "ckpt")
    res["loaded_dp_only"] = dp_only.full_state_dict()


def _reference(arch: str, data: dict) -> dict:
    """One process, no FSDP, no tp, whole batch, plain AdamW: the ground truth."""
    torch.manual_seed(0)
    with torch.no_grad():
        values = load_value_model(tiny_model_dir(arch))(
            data[keys.INPUT_IDS], data[keys.ATTENTION_MASK], data[keys.POSITION_IDS]
        )[:, -R - 1 : -1]
    ref: dict = {"values": torch.where(data[keys.ATTENTION_MASK][:, -R:].bool(), values, 0.0)}
    model = load_causal_lm(tiny_model_dir(arch))
    ref["log_probs"], ref["entropy"] = reference_log_probs(model, data)
    mask = data[keys.ATTENTION_MASK][:, -R:].float()
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], weight_decay=OPTIM["weight_decay"])
    for step in range(2):
        logits = model(
            input_ids=data[keys.INPUT_IDS],
            attention_mask=data[keys.ATTENTION_MASK],
            position_ids=data[keys.POSITION_IDS],
        ).logits[:, -R - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        if step == 0:
            ref["loss"] = float(loss.detach())
            ref["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"]))
        ref.setdefault("grad_norm", norm)
        opt.step()
        opt.zero_grad()
        ref["trained" if step == 0 else "continued"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ref


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=msg)


def _run(tmp_path: Path, world: int, tp: int, arch: str, full: bool = True, fsdp_size: int = 1) -> None:
    """`full`: also the other micro-batch layouts, a value model, and checkpoint -> tp=1 resume and HF
    exports. `fsdp_size`: 1 replicates over the dp groups (HSDP, a 3-D mesh when dp > 1), -1 shards over them."""
    tiny_model_dir(arch)  # build the cache once, before the workers race for it
    args = (world, tp, arch, free_port(), str(tmp_path), full, fsdp_size)
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    data, ranks = _data(), [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    ref, dp, rows = _reference(arch, data), world // tp, ROWS // (world // tp)
    assert [(r["dp_rank"], r["tp_rank"]) for r in ranks] == [(d, t) for d in range(dp) for t in range(tp)]
    assert ranks[0]["shared_pays"]  # the default layout really ran shared-prompt packing
    hf = load_causal_lm(tiny_model_dir(arch)).config
    shards = tp * (dp if fsdp_size == -1 else 1)
    assert all(r["q_rows"] == hf.hidden_size // shards for r in ranks)  # q_proj really split over tp (and dp)
    for r in ranks:
        want = slice(r["dp_rank"] * rows, (r["dp_rank"] + 1) * rows)
        for key in ("log_probs", "budget", "padded", "packed") if full else ("log_probs",):
            _close(r[key], ref["log_probs"][want], key)
        _close(r["entropy"], ref["entropy"][want], "entropy")
        if full:
            _close(r["values"], ref["values"][want], "values")
    # train_step's loss: each dp group's share of the global mean, times dp
    assert sum(r["metrics"]["loss"] for r in ranks if r["tp_rank"] == 0) / dp == pytest.approx(ref["loss"], rel=1e-5)
    for r in ranks:
        if full:
            assert r["loss"] == pytest.approx(r["metrics"]["loss"], rel=1e-6)
            for name, g in ref["grads"].items():
                _close(r["grads"][name], g, name)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        for name, w in ref["trained"].items():
            _close(r["trained"][name], w, name)
    init = load_causal_lm(tiny_model_dir(arch)).state_dict()
    assert max((ref["trained"][k] - init[k]).abs().max() for k in init) > 5e-4  # the step moved the weights
    if full:
        _check_tp1_resume_and_exports(tmp_path, arch, ranks[0], ref)


def _check_tp1_resume_and_exports(tmp_path: Path, arch: str, rank0: dict, ref: dict) -> None:
    """The tp checkpoint loads into a one-process tp=1 engine and into plain FSDP over the workers: same
    weights, and the next step (which needs the restored AdamW moments) matches; both HF exports hold the
    trained weights."""
    for name, w in rank0["loaded_dp_only"].items():
        torch.testing.assert_close(w, rank0["trained"][name], atol=0, rtol=0, msg=name)
    for name, w in load_causal_lm(tmp_path / "hf").state_dict().items():
        torch.testing.assert_close(w, rank0["trained"][name], atol=0, rtol=0, msg=name)
    for name, w in load_causal_lm(export_hf(tmp_path / "ckpt", tmp_path / "hf_ckpt")).state_dict().items():
        torch.testing.assert_close(w, rank0["trained"][name], atol=0, rtol=0, msg=name)
    engine = FSDPEngine.from_pretrained(tiny_model_dir(arch), EngineConfig(param_dtype="fp32"), OptimConfig(**OPTIM))
    engine.load_checkpoint(tmp_path / "ckpt")
    for name, w in engine.full_state_dict().items():
        torch.testing.assert_close(w, rank0["trained"][name], atol=0, rtol=0, msg=name)
    data = _data()
    engine.train_step(_micro(data, ROWS), policy_nll_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), 1, R))
    for name, w in engine.full_state_dict().items():
        _close(w, rank0["continued"][name], name)
        _close(w, ref["continued"][name], name)


def test_tp2_llama_matches_one_process(tmp_path):
    _run(tmp_path, world=2, tp=2, arch="llama", full=False)


@pytest.mark.slow
def test_tp2_llama_all_layouts_and_resumes_at_tp1(tmp_path):
    _run(tmp_path, world=2, tp=2, arch="llama")


@pytest.mark.slow
def test_tp2_qwen2_matches_one_process_and_resumes_at_tp1(tmp_path):
    _run(tmp_path, world=2, tp=2, arch="qwen2")


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_size", [1, -1], ids=["replicated-dp", "sharded-dp"])
def test_dp2_tp2_llama_matches_one_process_and_resumes_at_tp1(tmp_path, fsdp_size):
    _run(tmp_path, world=4, tp=2, arch="llama", fsdp_size=fsdp_size)


def test_layout_refused_with_the_numbers():
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 must divide num_attention_heads \(9\), "
        r"num_key_value_heads \(3\); the model has 9 attention heads",
    ):
        check_tp_layout(2, 2, 9, 3)
    with pytest.raises(ValueError, match=r"must divide the number of ranks \(3\)"):
        check_tp_layout(2, 3, 4, 2)
    check_tp_layout(3, 3, 9, 3)
    with pytest.raises(ValueError, match=r"engine.fsdp_size=3 must divide the number of dp groups \(2 = ranks"):
        EngineConfig(tensor_parallel_size=2, fsdp_size=3).resolve_fsdp_size(torch.device("cpu"), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def _smollm2_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3")
    torch.set_num_threads(1)
    data = _data()
    engine = FSDPEngine.from_pretrained(
        default_model_dir(), EngineConfig(param_dtype="fp32", tensor_parallel_size=3), OptimConfig(**OPTIM)
    )
    log_probs, _ = engine.compute_log_probs(data, 4)
    metrics = engine.train_step(_micro(data, 4), policy_nll_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), 1, R))
    torch.save({"log_probs": log_probs, "metrics": metrics}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_tp3_smollm2_log_probs_loss_and_grad_norm_match_one_process(tmp_path):
    """The default model's own layout (9 heads, 3 kv heads: 3 and 1 per rank) on 3 ranks."""
    mp.spawn(_smollm2_worker, args=(free_port(), str(tmp_path)), nprocs=3, join=True)
    data, model = _data(), load_causal_lm(default_model_dir())
    check_smollm2_one_step(model, data, R, [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)])
