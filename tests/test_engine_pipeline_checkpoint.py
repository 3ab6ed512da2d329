"""Checkpoints across layouts that include pipeline parallel, on gloo ranks with a tiny Llama (tied embeddings):
a pp2 checkpoint resumes at pp2 and in one process with the uninterrupted run's next step, loads at tp2 with the
pp2 engine's weights and optimizer state, and exports to HF (as does the pp2 engine); a one-process checkpoint
(optimizer state nested: settings per param group, the tied weight's moments under the embedding's name only)
resumes at pp2 with the one-process run's next step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig, export_hf
from hybridflow.engine.checkpoint import _saved_name, _settings_by_param
from hybridflow.models import load_causal_lm, tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import free_port, policy_nll_loss
from tests.test_engine_pipeline import _data, _micro
from tests.test_engine_sequence_parallel import OPTIM, R


def _engine(**layout) -> FSDPEngine:
    return FSDPEngine.from_pretrained(
        tiny_model_dir(), EngineConfig(param_dtype="fp32", **layout), OptimConfig(**OPTIM)
    )


def _step(engine: FSDPEngine) -> tuple[float, dict[str, torch.Tensor]]:
    """One train step on the test batch: (grad norm, the whole model after it)."""
    data = _data()
    loss_fn = policy_nll_loss(int(data[keys.ATTENTION_MASK][:, -R:].sum()), 1, R)
    return engine.train_step(_micro(data), loss_fn)["grad_norm"], engine.full_state_dict()


def _full_optim(engine: FSDPEngine) -> dict:
    """This rank's optimizer state, whole tensors, flattened: {"state.<param>.<moment>": t, "param_groups.<param>.<setting>": v}."""
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    optim = get_state_dict(engine.module, engine.optimizer, options=options)[1]
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optim.items()}  # step: the live tensor


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)


def _pp2_worker(rank: int, port: int, out_dir: str) -> None:
    _init(rank, port)
    out = Path(out_dir)
    from_one = _engine(pipeline_model_parallel_size=2)
    from_one.load_checkpoint(out / "one")
    res: dict = {"from_one_next": _step(from_one)}
    engine = _engine(pipeline_model_parallel_size=2)
    _step(engine)
    engine.save_checkpoint(out / "pp2")
    res["saved"], res["saved_optim"] = engine.full_state_dict(), _full_optim(engine)
    export_hf(engine, out / "hf_engine")
    resumed = _engine(pipeline_model_parallel_size=2)
    resumed.load_checkpoint(out / "pp2")
    res["next"], res["resumed_next"] = _step(engine), _step(resumed)
    torch.save(res, out / f"pp2_rank{rank}.pt")


def _tp2_worker(rank: int, port: int, out_dir: str) -> None:
    _init(rank, port)
    engine = _engine(tensor_parallel_size=2)
    engine.load_checkpoint(Path(out_dir) / "pp2")
    res = {"loaded": engine.full_state_dict(), "loaded_optim": _full_optim(engine)}
    torch.save(res, Path(out_dir) / f"tp2_rank{rank}.pt")


@pytest.fixture(scope="module")  # one process, then 2 gloo ranks at pp2, then 2 at tp2: ~55 s
def runs(tmp_path_factory) -> tuple[Path, dict, list[dict], list[dict]]:
    """One process steps once and saves ("one"), then takes its next step; 2 pp2 ranks resume from "one", and
    train, save ("pp2") and resume from it; 2 tp2 ranks load "pp2"."""
    out = tmp_path_factory.mktemp("pp_ckpt")
    one = _engine()
    _step(one)
    one.save_checkpoint(out / "one")
    one_next = _step(one)
    for worker in (_pp2_worker, _tp2_worker):
        mp.spawn(worker, args=(free_port(), str(out)), nprocs=2, join=True)
    load = lambda prefix: [torch.load(out / f"{prefix}_rank{r}.pt", weights_only=False) for r in range(2)]  # noqa: E731
    return out, {"next": one_next}, load("pp2"), load("tp2")


def _same_step(got: tuple, want: tuple) -> None:
    """A step's grad norm and weights; lost optimizer state would put the weights an lr-sized step apart."""
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, w in want[1].items():
        torch.testing.assert_close(got[1][name], w, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_pp2_checkpoint_resumes_at_pp2_and_at_pp1_and_exports(runs):
    """The stages save disjoint parts of the one-process state (the optimizer's flattened: settings per parameter);
    a resumed run's next step (AdamW moments and step count included) equals the uninterrupted one at pp 2 and 1;
    the HF export from the pp2 engine and from its checkpoint is the whole model."""
    out, _, pp2, _ = runs
    one = _engine()
    one.load_checkpoint(out / "pp2")
    exported = [export_hf(out / "pp2", out / "hf_ckpt"), out / "hf_engine"]
    for sd in [one.full_state_dict(), *(load_causal_lm(d).state_dict() for d in exported)]:
        for name, w in pp2[0]["saved"].items():
            torch.testing.assert_close(sd[name], w, atol=0, rtol=0, msg=name)
    one_next = _step(one)
    for r in pp2:
        _same_step(r["resumed_next"], r["next"])
        _same_step(one_next, r["next"])


@pytest.mark.slow
def test_pp2_checkpoint_loads_at_tp2_with_the_pp2_weights_and_optimizer_state(runs):
    """Every tp2 rank holds, whole, the pp2 engine's weights and every optimizer tensor and setting it saved (the
    tied weight's under the name tp2 keeps it by)."""
    _, _, pp2, tp2 = runs
    saved_optim = {**pp2[0]["saved_optim"], **pp2[1]["saved_optim"]}  # the stages' disjoint parts
    for r in tp2:
        assert r["loaded"].keys() == pp2[0]["saved"].keys()
        for name, w in pp2[0]["saved"].items():
            torch.testing.assert_close(r["loaded"][name], w, atol=0, rtol=0, msg=name)
        assert any(k.endswith(".exp_avg_sq") for k in r["loaded_optim"])
        for key, got in r["loaded_optim"].items():
            if isinstance(got, torch.Tensor):
                torch.testing.assert_close(got, saved_optim[key], atol=0, rtol=0, msg=key)
            else:
                assert got == saved_optim[key], key


@pytest.mark.slow
def test_one_process_checkpoint_resumes_at_pp2(runs):
    """The nested optimizer state of a one-process checkpoint reaches both stages (the last stage's LM head takes
    the embedding's moments): the next step at pp2 equals the one-process run's."""
    _, one, pp2, _ = runs
    for r in pp2:
        _same_step(r["from_one_next"], one["next"])


def test_nested_optimizer_settings_and_the_tied_head_map_to_a_stages_flat_names():
    groups = {"param_groups.0.lr": 0.1, "param_groups.0.params": ["a.weight", "model.embed_tokens.weight"]}
    groups |= {"param_groups.1.lr": 0.2, "param_groups.1.params": ["b.bias"]}
    by_param = _settings_by_param(groups)
    assert by_param["a.weight"]["lr"] == 0.1 and by_param["b.bias"]["lr"] == 0.2
    saved = {"optim.state.model.embed_tokens.weight.exp_avg": None, "optim.state.b.bias.exp_avg": None}
    assert _saved_name("state.lm_head.weight.exp_avg", saved) == "state.model.embed_tokens.weight.exp_avg"
    assert _saved_name("state.lm_head.weight.exp_avg", {"optim.state.lm_head.weight.exp_avg": None}) == (
        "state.lm_head.weight.exp_avg"
    )
    assert _saved_name("state.b.bias.exp_avg", saved) == "state.b.bias.exp_avg"
