"""Ulysses sequence parallel x FSDP2 on gloo ranks computes what one plain process computes: log-probs and
entropy (shared-prompt, plainly packed and token-budget micro-batches of several examples), values, the
loss, gradients and one AdamW step, the critic's gradient norm; with heads that split evenly over sp and
with whole kv groups split unevenly (3 kv heads over 2 ranks, as SmolLM2's 9/3 heads), and with one kv head's
q heads split over 2 ranks (as SmolLM2's at tensor parallel 3); the checkpoint
restores into a one-process engine without sequence parallel; LoRA adapters train as in one process."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.engine import EngineConfig, FSDPEngine, LoraConfig, OptimConfig
from hybridflow.engine.batch import PackedBatch, TokenBudget
from hybridflow.engine.parallel.sequence_parallel import (
    check_sp_layout,
    kv_head_splits,
    padded_row,
)
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
MODELS = {  # name -> tiny_model_dir arguments
    "llama": dict(arch="llama"),  # 4 heads, 2 kv heads: 1 kv group per rank at sp 2
    "qwen2-uneven": dict(arch="qwen2", hidden_size=48, num_heads=6, num_kv_heads=3),  # kv groups 2 + 1
    "llama-kv6": dict(arch="llama", hidden_size=48, num_heads=6, num_kv_heads=6),  # sp 4: 2 + 2 + 1 + 1 heads
    "qwen2-kv1": dict(arch="qwen2", hidden_size=48, num_heads=3, num_kv_heads=1),  # one kv group over 2 ranks
}


def _data() -> dict[str, torch.Tensor]:
    return make_group_batch(PROMPTS, N, P, R, seed=3)


def _value_loss(global_tokens: int, dp_size: int):
    def fn(out, micro):
        mask = micro[keys.ATTENTION_MASK][:, -R:].float()
        return ((out["values"] - 1.0) ** 2 * mask).sum() / global_tokens * dp_size, {}

    return fn


def _micro(shard: dict, size: int = 2) -> list[dict]:
    rows = shard[keys.INPUT_IDS].shape[0]
    return [{k: v[i : i + size] for k, v in shard.items()} for i in range(0, rows, size)]


def _worker(rank: int, world: int, sp: int, model: str, port: int, out_dir: str, fsdp_size: int, gc: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    path, data = tiny_model_dir(**MODELS[model]), _data()
    cfg = EngineConfig(
        param_dtype="fp32", ulysses_sequence_parallel_size=sp, fsdp_size=fsdp_size, gradient_checkpointing=gc
    )
    engine = FSDPEngine.from_pretrained(path, cfg, OptimConfig(**OPTIM))
    dp, rows = engine.dp_size, ROWS // engine.dp_size
    shard = {k: v[engine.dp_rank * rows : (engine.dp_rank + 1) * rows] for k, v in data.items()}
    res: dict = {"dp_rank": engine.dp_rank, "sp_rank": engine.sp_rank}
    res["log_probs"], res["entropy"] = engine.compute_log_probs(shard, 2, calc_entropy=True)
    res["budget"], _ = engine.compute_log_probs(shard, TokenBudget(30))
    engine.config = replace(cfg, packing=True)
    res["packed"], _ = engine.compute_log_probs(shard, 4)
    engine.config = cfg
    tokens = int(data[keys.ATTENTION_MASK][:, -R:].sum())
    loss_fn = policy_nll_loss(tokens, dp, R)
    res["loss"] = 0.0
    for micro in _micro(shard):
        loss, _ = loss_fn(engine.forward_micro_batch(micro), micro)
        loss.backward()
        res["loss"] += float(loss.detach())
    res["grads"] = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    res["metrics"] = engine.train_step(_micro(shard), loss_fn)
    res["trained"] = engine.full_state_dict()
    engine.save_checkpoint(Path(out_dir) / "ckpt")
    torch.manual_seed(0)  # the value head starts random: the same on every rank and in the reference
    critic = FSDPEngine.from_pretrained(path, cfg, OptimConfig(**OPTIM), value_model=True)
    res["values"] = critic.compute_values(shard, 4)
    res["critic"] = critic.train_step(_micro(shard), _value_loss(tokens, dp))
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def _reference(path: Path, data: dict) -> dict:
    """One process, no FSDP, whole batch, plain AdamW: the ground truth."""
    mask = data[keys.ATTENTION_MASK][:, -R:].float()
    inputs = dict(
        input_ids=data[keys.INPUT_IDS], attention_mask=data[keys.ATTENTION_MASK], position_ids=data[keys.POSITION_IDS]
    )
    torch.manual_seed(0)
    critic = load_value_model(path)
    values = critic(**inputs)[:, -R - 1 : -1]
    vloss = ((values - 1.0) ** 2 * mask).sum() / mask.sum()
    vloss.backward()
    ref: dict = {
        "values": torch.where(mask.bool(), values.detach(), 0.0),
        "critic_norm": float(torch.nn.utils.get_total_norm([p.grad for p in critic.parameters()])),
    }
    model = load_causal_lm(path)
    ref["log_probs"], ref["entropy"] = reference_log_probs(model, data)
    logits = model(**inputs).logits[:, -R - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    ref["loss"], ref["grads"] = float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}
    ref["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"]))
    torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], weight_decay=OPTIM["weight_decay"]).step()
    ref["trained"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ref


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{msg}: {m}")


def _run(tmp_path: Path, world: int, sp: int, model: str, fsdp_size: int = 1, gc: bool = False) -> None:
    """`gc`: gradient checkpointing (the backward recomputes attention, all-to-alls included)."""
    path = tiny_model_dir(**MODELS[model])  # build the cache once, before the workers race for it
    mp.spawn(_worker, args=(world, sp, model, free_port(), str(tmp_path), fsdp_size, gc), nprocs=world, join=True)
    data, ranks = _data(), [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    ref, dp, rows = _reference(path, data), world // sp, ROWS // (world // sp)
    assert [(r["dp_rank"], r["sp_rank"]) for r in ranks] == [(d, s) for d in range(dp) for s in range(sp)]
    for r in ranks:
        want = slice(r["dp_rank"] * rows, (r["dp_rank"] + 1) * rows)
        for key in ("log_probs", "budget", "packed"):
            _close(r[key], ref["log_probs"][want], key)
        _close(r["entropy"], ref["entropy"][want], "entropy")
        _close(r["values"], ref["values"][want], "values")
        assert r["loss"] == pytest.approx(r["metrics"]["loss"], rel=1e-6)
        for name, g in ref["grads"].items():
            _close(r["grads"][name], g, name)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert r["critic"]["grad_norm"] == pytest.approx(ref["critic_norm"], rel=1e-4)
        for name, w in ref["trained"].items():  # AdamW's first step is ~lr * sign(g): looser where g ~ 0
            torch.testing.assert_close(r["trained"][name], w, atol=OPTIM["lr"] / 10, rtol=1e-4, msg=name)
    # every sp rank computes its dp group's whole loss: each group's share of the global mean, times dp
    assert sum(r["metrics"]["loss"] for r in ranks if r["sp_rank"] == 0) / dp == pytest.approx(ref["loss"], rel=1e-5)
    init = load_causal_lm(path).state_dict()
    assert max((ref["trained"][k] - init[k]).abs().max() for k in init) > 5e-4  # the step moved the weights
    # the checkpoint is the plain FSDP layout: it restores into a one-process engine without sequence parallel
    restored = FSDPEngine.from_pretrained(path, EngineConfig(param_dtype="fp32"), OptimConfig(**OPTIM))
    restored.load_checkpoint(tmp_path / "ckpt")
    for name, w in restored.full_state_dict().items():
        torch.testing.assert_close(w, ranks[0]["trained"][name], atol=0, rtol=0, msg=name)


def test_sp2_llama_matches_one_process(tmp_path):
    _run(tmp_path, world=2, sp=2, model="llama")


def test_sp2_qwen2_uneven_kv_groups_match_one_process_with_checkpointing(tmp_path):
    _run(tmp_path, world=2, sp=2, model="qwen2-uneven", gc=True)


def test_sp2_one_kv_head_split_over_the_ranks_matches_one_process(tmp_path):
    # SmolLM2 at tensor parallel 3 leaves each rank 3 q heads and 1 kv head: the kv head's copies go to 2 + 1 q heads
    _run(tmp_path, world=2, sp=2, model="qwen2-kv1")


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_size", [1, -1], ids=["replicated", "sharded-over-dp-x-sp"])
def test_dp2_sp2_llama_matches_one_process(tmp_path, fsdp_size):
    _run(tmp_path, world=4, sp=2, model="llama", fsdp_size=fsdp_size)


@pytest.mark.slow
def test_sp4_llama_uneven_heads_matches_one_process(tmp_path):
    _run(tmp_path, world=4, sp=4, model="llama-kv6")


def _lora_run(engine, data: dict) -> dict:
    """Log-probs with and without the adapters, one step, then the merged weights."""
    out: dict = {"log_probs": engine.compute_log_probs(data, 2)[0]}
    with engine.adapters_disabled():
        out["base"] = engine.compute_log_probs(data, 2)[0]
    tokens = int(data[keys.ATTENTION_MASK][:, -R:].sum())
    out["metrics"] = engine.train_step(_micro(data), policy_nll_loss(tokens, 1, R))
    out["merged"] = engine.full_state_dict()
    return out


def _lora_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    engine = FSDPEngine.from_pretrained(
        tiny_model_dir(),
        EngineConfig(param_dtype="fp32", ulysses_sequence_parallel_size=2),
        OptimConfig(lr=1e-2),
        lora=LoraConfig(rank=4),
    )
    torch.save(_lora_run(engine, _data()), Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_sp2_lora_matches_one_process(tmp_path):
    """Adapters need nothing of sequence parallel: log-probs with and without them, the step, the merged weights."""
    tiny_model_dir()
    mp.spawn(_lora_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ref = _lora_run(
        FSDPEngine.from_pretrained(
            tiny_model_dir(), EngineConfig(param_dtype="fp32"), OptimConfig(lr=1e-2), lora=LoraConfig(rank=4)
        ),
        _data(),
    )
    assert (
        ref["merged"]["model.layers.0.self_attn.q_proj.weight"]
        - load_causal_lm(tiny_model_dir()).state_dict()["model.layers.0.self_attn.q_proj.weight"]
    ).abs().max() > 1e-4
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        _close(got["log_probs"], ref["log_probs"])
        _close(got["base"], ref["base"])
        assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4)
        for name, w in ref["merged"].items():
            _close(got["merged"][name], w, name)


def test_padded_row_has_one_attention_block_per_example_and_one_for_the_padding():
    rmask = torch.ones(2, 1, dtype=torch.bool)
    packed = PackedBatch(
        input_ids=torch.arange(5)[None],
        position_ids=torch.tensor([[0, 1, 2, 0, 1]]),
        predictors=torch.tensor([1, 3]),
        labels=torch.tensor([2, 4]),
        response_mask=rmask,
    )
    ids, pos, blocks = padded_row(packed, 4)
    assert ids.shape == (1, 8) and pos[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert blocks == [(0, 3, None), (3, 5, None), (5, 8, None)]
    shared = replace(packed, attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool).tril())
    _, _, blocks = padded_row(shared, 4)
    assert [(a, b, None if m is None else m.shape) for a, b, m in blocks] == [
        (0, 3, (3, 3)),
        (3, 5, (2, 2)),
        (5, 8, None),
    ]


def test_head_splits_and_layout_refused_with_the_numbers():
    assert kv_head_splits(3, 2) == [2, 1] and kv_head_splits(2, 2) == [1, 1] and kv_head_splits(9, 4) == [3, 2, 2, 2]
    check_sp_layout(2, 2, 9, 3)  # SmolLM2 at sp 2: 6 + 3 query heads
    check_sp_layout(4, 4, 9, 3)  # more ranks than kv heads: kv heads repeated, 3 + 2 + 2 + 2 query heads
    with pytest.raises(
        ValueError,
        match=r"ulysses_sequence_parallel_size=12 must be at most num_attention_heads "
        r"\(9\).*the model has 9 attention heads and 3 kv heads",
    ):
        check_sp_layout(12, 12, 9, 3)
    with pytest.raises(ValueError, match=r"=2 must divide the number of ranks \(3\)"):
        check_sp_layout(2, 3, 4, 2)
    assert EngineConfig(tensor_parallel_size=2, ulysses_sequence_parallel_size=2).dp_size(8) == 2  # composes
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size must be >= 1"):
        EngineConfig(ulysses_sequence_parallel_size=0)
    with pytest.raises(
        ValueError,
        match=r"actor.engine.ulysses_sequence_parallel_size=2 must divide the number "
        r"of ranks \(3\)",
    ):
        EngineConfig(ulysses_sequence_parallel_size=2).dp_size(3, "actor.engine.")
    assert EngineConfig(ulysses_sequence_parallel_size=2).dp_size(4) == 2


def _smollm2_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    data = _data()
    engine = FSDPEngine.from_pretrained(
        default_model_dir(), EngineConfig(param_dtype="fp32", ulysses_sequence_parallel_size=2), OptimConfig(**OPTIM)
    )
    log_probs, _ = engine.compute_log_probs(data, 4)
    metrics = engine.train_step(_micro(data, 4), policy_nll_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), 1, R))
    torch.save({"log_probs": log_probs, "metrics": metrics}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_sp2_smollm2_log_probs_loss_and_grad_norm_match_one_process(tmp_path):
    """The default model (9 heads, 3 kv heads: 6 and 3 query heads per rank) on 2 ranks, one step."""
    mp.spawn(_smollm2_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    data, model = _data(), load_causal_lm(default_model_dir())
    check_smollm2_one_step(model, data, R, [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)])
