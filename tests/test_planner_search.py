"""`hybridflow plan` (planner/search.py): ranking, runnable placements, plan.yaml."""

import json

from hybridflow.cli.main import main
from hybridflow.config.plan_inputs import run_shape
from hybridflow.config.run import RunConfig
from hybridflow.planner.inputs import forward_ops
from hybridflow.planner.plans import PlacementSet, Plan, RoleParallel
from hybridflow.planner.search import placement_of
from hybridflow.utils.config_loader import load_config

PROFILE = [  # a colocated PPO run on 2 workers: medians and tokens per step
    {"metric": "timing_s/step", "median_s": 12.0, "tokens_per_step": 1000.0},
    {"metric": "timing_s/gen", "median_s": 4.0, "tokens_per_step": 400.0},
    {"metric": "timing_s/old_log_prob_ref_values", "median_s": 2.0, "tokens_per_step": 1000.0},
    {"metric": "timing_s/update_actor_on_worker", "median_s": 4.0, "tokens_per_step": 1000.0},
    {"metric": "timing_s/update_critic_on_worker", "median_s": 2.0, "tokens_per_step": 1000.0},
]
PPO = ["algorithm.adv_estimator=gae", "trainer.backend=ray", "trainer.n_workers_per_node=2"]


def test_placement_of_todays_layouts():
    def plan(*sets):
        return Plan(tuple(PlacementSet(r, n) for r, n in sets), tuple((x, RoleParallel(n)) for r, n in sets for x in r))

    assert placement_of(plan((("actor_rollout", "critic"), 4)), 4) == "colocate"
    assert placement_of(plan((("actor_rollout",), 2), (("ref", "critic"), 2)), 4) == "split"
    assert placement_of(plan((("actor_rollout",), 1), (("ref", "critic"), 3)), 4) is None
    assert placement_of(plan((("actor_rollout", "ref"), 2), (("critic",), 2)), 4) is None


def test_plan_cli_ranks_and_writes_a_loadable_plan(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    out = tmp_path / "plan.yaml"
    assert (
        main(
            ["plan", "--profile", str(profile), "--params", "1e8", "--device-memory-gb", "10", "--out", str(out), *PPO]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert forward_ops(run_shape(load_config(RunConfig, None, PPO))) == ("old_log_prob", "values")
    # costs per token per device: gen 4*2/400 = 0.02; the forward phase split between old log-probs and
    # values, 0.002 each; update actor 0.008, critic 0.004
    # colocate x2: 0.02*400/2 + (0.002+0.002)*1000/2 + (0.008+0.004)*1000/2 = 4 + 2 + 6 = 12
    # split 1+1: 0.02*400 + max(2, 2) + max(8, 4) = 8 + 2 + 8 = 18
    assert lines[0].split()[:2] == ["1.", "12.00"] and "(trainer.placement=colocate)" in lines[0]
    assert lines[1].split()[:2] == ["2.", "18.00"] and "(trainer.placement=split)" in lines[1]
    assert lines[-1].startswith(f"wrote {out}")
    cfg = load_config(RunConfig, out)
    assert cfg.trainer.placement == "colocate" and cfg.use_critic and cfg.world_size == 2


def test_plan_cli_memory_pruning_and_bad_profile(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    # 1e8 params, fp32 trained: 1.6 GB per model unsharded; colocate x2 = 0.8 + 0.8, split = 1.6
    assert (
        main(
            [
                "plan",
                "--profile",
                str(profile),
                "--params",
                "1e8",
                "--device-memory-gb",
                "1.0",
                "--out",
                str(tmp_path / "p.yaml"),
                *PPO,
            ]
        )
        == 1
    )
    assert "no plan fits" in capsys.readouterr().out
    profile.write_text(json.dumps(PROFILE[2:]))
    assert main(["plan", "--profile", str(profile), "--params", "1e8", *PPO]) == 2
    assert "no step/generate rows" in capsys.readouterr().err


def test_model_params_counts_safetensors_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    from hybridflow.planner.search import model_params

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model-1.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-2.safetensors"))
    assert model_params(str(tmp_path)) == 12 + 5 + 8
