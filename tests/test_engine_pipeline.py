"""Pipeline parallel (engine.pipeline_model_parallel_size, engine/parallel/pipeline.py) on gloo ranks computes what one plain
process computes: log-probs and entropy (micro-batches of uneven rows), values, the loss, every stage's gradients
(the tied embedding / LM head summed across the first and last stage), the global gradient norm and one AdamW step
with clipping; at pp2, pp2 x dp2 (FSDP sharded over the dp ranks of each stage) and pp2 x tp2, on tiny Llama and
Qwen2 models with tied embeddings. The outputs and metrics reach every stage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.config.run import RunConfig
from hybridflow.config.sft import SFTConfig
from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engine.batch import TokenBudget
from hybridflow.engine.parallel.pipeline_stage import HeadSpec, check_pp_layout, split_stage, stage_layers
from hybridflow.models import default_model_dir, load_causal_lm, load_value_model, tiny_model_dir
from hybridflow.protocol import DataProto, keys
from hybridflow.utils.config_loader import ConfigError, load_config
from hybridflow.workers import ActorConfig
from hybridflow.workers.losses import actor_loss_builder
from hybridflow.workers.ppo_update import run_ppo_update
from tests.engine_helpers import (
    check_smollm2_one_step,
    free_port,
    make_group_batch,
    policy_nll_loss,
    reference_log_probs,
)
from tests.resolve_helpers import resolve_here
from tests.test_engine_sequence_parallel import OPTIM, ROWS, R, _reference, _value_loss


def _data() -> dict[str, torch.Tensor]:
    return make_group_batch(4, 2, 12, R, seed=3)


def _micro(shard: dict, size: int = 2) -> list[dict]:
    rows = shard[keys.INPUT_IDS].shape[0]
    return [{k: v[i : i + size] for k, v in shard.items()} for i in range(0, rows, size)]


def _grads(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in engine.module.named_parameters() if p.grad is not None}


def _ppo_batch(engine: FSDPEngine, data: dict) -> DataProto:
    """`data` as a rollout batch: response mask, advantages of both signs, old log-probs a little off the current."""
    mask = data[keys.ATTENTION_MASK][:, -R:]
    advantages = torch.cos(data[keys.INPUT_IDS][:, :1].float()) * mask  # a row's own, wherever the row is
    old, _ = engine.compute_log_probs(data, 4)
    extra = {keys.RESPONSE_MASK: mask, keys.ADVANTAGES: advantages, keys.OLD_LOG_PROBS: old + 0.1 * mask}
    return DataProto.from_dict({**data, **extra})


def _ppo_update(path: Path, cfg: EngineConfig, data: dict, mini_rows: int) -> dict:
    """Two PPO steps (two mini-batches) the way the actor worker runs them: the loss normalised by the mini-batch's
    token count over every rank (`global_norm`), summed over micro-batches of 2 rows."""
    engine = FSDPEngine.from_pretrained(path, cfg, OptimConfig(**OPTIM))
    batch = _ppo_batch(engine, data)
    metrics = run_ppo_update(engine, batch, mini_rows, 2, 1, actor_loss_builder(ActorConfig()))
    return {"grad_norm": metrics["grad_norm"], "trained": engine.full_state_dict()}


def _ppo_order(dp: int, rows: int) -> list[int]:
    """The global rows of each mini-batch when dp groups of `rows` rows each take their halves in turn."""
    m = rows // 2
    return [d * rows + j * m + i for j in range(2) for d in range(dp) for i in range(m)]


def _worker(rank: int, world: int, model: dict, layout: dict, ppo: bool, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    path, data = tiny_model_dir(**model), _data()
    cfg = EngineConfig(param_dtype="fp32", **layout)
    engine = FSDPEngine.from_pretrained(path, cfg, OptimConfig(**OPTIM))
    dp, rows = engine.dp_size, ROWS // engine.dp_size
    shard = {k: v[engine.dp_rank * rows : (engine.dp_rank + 1) * rows] for k, v in data.items()}
    res: dict = {"coords": (engine.pp_rank, engine.dp_rank, engine.tp_rank), "dp": dp, "rows": rows}
    res["names"] = sorted(n for n, _ in engine.module.named_parameters())
    q_proj = next(iter(engine.module.model.layers.values())).self_attn.q_proj.weight
    res["q_rows"] = q_proj.to_local().shape[0]
    res["log_probs"], res["entropy"] = engine.compute_log_probs(shard, 3, calc_entropy=True)  # 3 + 3 + 2 rows
    res["budget"], _ = engine.compute_log_probs(shard, TokenBudget(30))
    loss_fn = policy_nll_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), dp, R)
    run = engine.pipeline.train(_micro(shard), _spec(engine), loss_fn, cfg.use_remove_padding)
    engine.pipeline.sync_tied_grad()
    res["loss"], res["grads"] = run["loss"], _grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)
    res["metrics"] = engine.train_step(_micro(shard), loss_fn)
    res["trained"] = engine.full_state_dict()
    torch.manual_seed(0)  # the value head starts random: the same on every rank and in the reference
    critic = FSDPEngine.from_pretrained(path, cfg, OptimConfig(**OPTIM), value_model=True)
    res["values"] = critic.compute_values(shard, 4)
    res["critic"] = critic.train_step(
        _micro(shard, rows), _value_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), dp)
    )
    if ppo:
        res["ppo"] = _ppo_update(path, cfg, shard, rows // 2)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def _spec(engine: FSDPEngine) -> HeadSpec:
    return HeadSpec(0, chunk=engine.config.logits_chunk_size)


def _close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda details: f"{msg}: {details}")


def _run(tmp_path: Path, world: int, model: dict, ppo: bool = False, **layout) -> list[dict]:
    """`ppo`: also two PPO steps through the workers' update loop (`run_ppo_update`), against one process."""
    path = tiny_model_dir(**model)  # build the cache once, before the workers race for it
    mp.spawn(_worker, args=(world, model, layout, ppo, free_port(), str(tmp_path)), nprocs=world, join=True)
    data, ranks = _data(), [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    ref = _reference(path, data)
    for r in ranks:
        want = slice(r["coords"][1] * r["rows"], (r["coords"][1] + 1) * r["rows"])
        _close(r["log_probs"], ref["log_probs"][want], "log_probs")
        _close(r["budget"], ref["log_probs"][want], "token-budget log_probs")
        _close(r["entropy"], ref["entropy"][want], "entropy")
        _close(r["values"], ref["values"][want], "values")
        assert r["loss"] == pytest.approx(r["metrics"]["loss"], rel=1e-6)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert r["critic"]["grad_norm"] == pytest.approx(ref["critic_norm"], rel=1e-4)
        for name, g in r["grads"].items():
            _close(g, ref["grads"][_untied(name)], f"grad {name}")
        assert r["trained"].keys() == ref["trained"].keys()
        for name, w in ref["trained"].items():  # AdamW's first step is ~lr * sign(g): looser where g ~ 0
            torch.testing.assert_close(r["trained"][name], w, atol=OPTIM["lr"] / 10, rtol=1e-4, msg=name)
    # the stages' parameters are disjoint and together the whole model (the tied weight on both ends)
    if ppo:
        dp, rows = ranks[0]["dp"], ranks[0]["rows"]
        want = _ppo_update(path, EngineConfig(param_dtype="fp32"), _rows(data, _ppo_order(dp, rows)), ROWS // 2)
        for r in ranks:
            assert r["ppo"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            for name, w in want["trained"].items():
                torch.testing.assert_close(r["ppo"]["trained"][name], w, atol=OPTIM["lr"] / 10, rtol=1e-4, msg=name)
    stage_names = [set(r["names"]) for r in ranks if r["coords"][1:] == (0, 0)]
    assert set.union(*stage_names) | {"model.embed_tokens.weight"} >= {_untied(n) for n in ref["grads"]}
    assert sum(len(s) for s in stage_names) == len(set.union(*stage_names))
    # each dp group's loss is its share of the global mean, times dp (as without pp)
    dp = ranks[0]["dp"]
    losses = {r["coords"][1]: r["metrics"]["loss"] for r in ranks}
    assert sum(losses.values()) / dp == pytest.approx(ref["loss"], rel=1e-5)
    return ranks


def _rows(data: dict, order: list[int]) -> dict:
    return {k: v[order] for k, v in data.items()}


def _untied(name: str) -> str:
    return "model.embed_tokens.weight" if name == "lm_head.weight" else name


def test_pp2_llama_matches_one_process(tmp_path):
    ranks = _run(tmp_path, 2, dict(arch="llama"), pipeline_model_parallel_size=2)
    assert all(r["q_rows"] == 64 for r in ranks)
    first, last = (set(r["names"]) for r in ranks)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    assert any(n.startswith("model.layers.1.") for n in last) and not any(
        n.startswith("model.layers.1.") for n in first
    )


@pytest.mark.slow  # 4 gloo processes on 2 CPU cores
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pp2_dp2_matches_one_process(tmp_path, arch):
    layout = dict(pipeline_model_parallel_size=2, fsdp_size=-1)
    ranks = _run(tmp_path, 4, dict(arch=arch, num_layers=4), ppo=True, **layout)
    assert [r["coords"] for r in ranks] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]  # pp outermost
    assert all(r["q_rows"] == 32 for r in ranks)  # FSDP shards each stage over its 2 dp ranks


@pytest.mark.slow
def test_pp2_qwen2_matches_one_process_with_checkpointing(tmp_path):
    _run(tmp_path, 2, dict(arch="qwen2", num_layers=4), pipeline_model_parallel_size=2, gradient_checkpointing=True)


@pytest.mark.slow
def test_pp2_tp2_matches_one_process(tmp_path):
    ranks = _run(tmp_path, 4, dict(arch="llama"), True, pipeline_model_parallel_size=2, tensor_parallel_size=2)
    assert [r["coords"] for r in ranks] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert all(r["q_rows"] == 32 for r in ranks)  # each stage's layers split over its 2 tp ranks


def _stage_outputs(path: Path, data: dict, value: bool = False) -> tuple:
    """Two stages of the model at `path`, each cut from its own copy, run one after the other in this process."""
    mask, pos = data[keys.ATTENTION_MASK], data[keys.POSITION_IDS]
    load = (lambda: (torch.manual_seed(0), load_value_model(path))[1]) if value else (lambda: load_causal_lm(path))
    first, last = split_stage(load(), 0, 2), split_stage(load(), 1, 2)
    width = mask.shape[1]
    last.spec = HeadSpec(R, value_first=width - R - 1, calc_entropy=True)
    with torch.no_grad():
        hidden = first(data[keys.INPUT_IDS], attention_mask=mask, position_ids=pos)
        return first, last, last(hidden, attention_mask=mask, position_ids=pos, labels=data[keys.RESPONSES])


def test_two_stages_in_one_process_are_the_whole_model():
    path, data = tiny_model_dir(num_layers=4), _data()
    first, last, (log_probs, entropy) = _stage_outputs(path, data)
    rmask = data[keys.ATTENTION_MASK][:, -R:].bool()
    want_lp, want_ent = reference_log_probs(load_causal_lm(path), data)
    _close(torch.where(rmask, log_probs, 0.0), want_lp, "log_probs")
    _close(torch.where(rmask, entropy, 0.0), want_ent, "entropy")
    names = [{n for n, _ in stage.named_parameters()} for stage in (first, last)]
    assert {n.split(".")[2] for n in names[0] if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in names[1] if n.startswith("model.layers.")} == {"2", "3"}
    assert names[0].isdisjoint(names[1]) and first.tied and last.tied
    assert first.tied_weight() is first.get_submodule("model.embed_tokens").weight
    assert last.tied_weight() is last.get_submodule("lm_head").weight
    _, _, (values,) = _stage_outputs(path, data, value=True)
    torch.manual_seed(0)
    inputs = {k: data[k] for k in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)}
    with torch.no_grad():
        want = load_value_model(path)(**inputs)[:, -R - 1 : -1]
    _close(values, want, "values")


def test_stage_layers_split_evenly_or_are_refused():
    assert [stage_layers(30, s, 3) for s in range(3)] == [range(0, 10), range(10, 20), range(20, 30)]
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=4 must divide num_hidden_layers \(30\)"):
        check_pp_layout(4, 30)
    with pytest.raises(ValueError, match="stage 2 is outside the 2 pipeline stages"):
        stage_layers(4, 2, 2)


def test_what_pipeline_parallel_does_not_combine_with_is_refused_at_load():
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 does not combine with engine.ulysses_seq"):
        EngineConfig(pipeline_model_parallel_size=2, ulysses_sequence_parallel_size=2)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 does not combine with engine.packing=true"):
        EngineConfig(pipeline_model_parallel_size=2, packing=True)
    with pytest.raises(ValueError, match=r"engine.pipeline_model_parallel_size must be >= 1, got 0"):
        EngineConfig(pipeline_model_parallel_size=0)
    assert EngineConfig(pipeline_model_parallel_size=2, tensor_parallel_size=2).dp_size(8) == 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x actor.engine.pipeline_model_parallel_size=2 must"):
        EngineConfig(pipeline_model_parallel_size=2, tensor_parallel_size=2).dp_size(6, "actor.engine.")
    lora = ["actor.engine.pipeline_model_parallel_size=2", "actor.lora.rank=4"]
    with pytest.raises(
        ConfigError, match=r"actor.engine.pipeline_model_parallel_size > 1 does not combine with actor.lo"
    ):
        resolve_here(load_config(RunConfig, None, lora), steps_per_epoch=4)
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size > 1: SFT runs data parallel only"):
        load_config(SFTConfig, None, ["engine.pipeline_model_parallel_size=2"])


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize(
    ("pp", "workers", "message"),
    [
        (2, 2, None),
        (4, 4, r"{role}.engine.pipeline_model_parallel_size=4 must divide num_hidden_layers \(30\).*\(model "),
        (3, 2, r"{role}.engine.pipeline_model_parallel_size=3 must divide the number of ranks \(2\) of its worker set"),
    ],
    ids=["fits", "layers-do-not-split", "ranks-do-not-split"],
)
def test_a_pipeline_is_checked_against_its_layers_and_ranks_when_resolved(role, pp, workers, message):
    overrides = ["algorithm.adv_estimator=gae", f"trainer.n_workers_per_node={workers}", "rollout.n=4"]
    cfg = load_config(RunConfig, None, [*overrides, f"{role}.engine.pipeline_model_parallel_size={pp}"])
    if message is None:
        resolved = resolve_here(cfg, steps_per_epoch=4).config
        assert getattr(resolved, role).engine.pipeline_model_parallel_size == pp
        return
    message = message.format(role=role)
    with pytest.raises(ConfigError, match=message):
        resolve_here(cfg, steps_per_epoch=4)


def _smollm2_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3")
    torch.set_num_threads(1)
    data = _data()
    cfg = EngineConfig(param_dtype="fp32", pipeline_model_parallel_size=3)
    engine = FSDPEngine.from_pretrained(default_model_dir(), cfg, OptimConfig(**OPTIM))
    log_probs, _ = engine.compute_log_probs(data, 4)
    metrics = engine.train_step(_micro(data, 2), policy_nll_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), 1, R))
    layers = sorted(int(i) for i in engine.module.model.layers)
    torch.save({"log_probs": log_probs, "metrics": metrics, "layers": layers}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_pp3_smollm2_log_probs_loss_and_grad_norm_match_one_process(tmp_path):
    """The default model (30 layers, tied embeddings) in 3 stages of 10 layers, a middle stage between the tied ends."""
    mp.spawn(_smollm2_worker, args=(free_port(), str(tmp_path)), nprocs=3, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert [r["layers"] for r in ranks] == [list(range(s * 10, s * 10 + 10)) for s in range(3)]
    check_smollm2_one_step(load_causal_lm(default_model_dir()), _data(), R, ranks)
