"""The resolve stage: derived values computed once from the final merged config, frozen, never
overwriting a user value; load-time refusals; the step plan; `hybridflow train --print-config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from hybridflow.config.resolve import plan_step
from hybridflow.config.run import RunConfig
from hybridflow.engine.config import EngineConfig
from hybridflow.train.checkpointing import STATE_FILE, resume_path
from hybridflow.utils.config_loader import ConfigError, FrozenConfigError, load_config
from hybridflow.utils.manifest import write_manifest
from tests.resolve_helpers import resolve_here


def _load(tmp_path: Path, source: str, overrides: list[str]) -> RunConfig:
    """The same settings given as command-line overrides or as a YAML file."""
    if source == "cli":
        return load_config(RunConfig, None, overrides)
    nested: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(nested))
    return load_config(RunConfig, path)


@pytest.mark.parametrize("source", ["cli", "yaml"])
def test_names_and_layout_derive_from_the_final_values(tmp_path, source):
    cfg = _load(
        tmp_path,
        source,
        ["trainer.project_name=p", "trainer.experiment_name=b", "trainer.n_workers_per_node=1", "trainer.nnodes=2"],
    )
    t = resolve_here(cfg, steps_per_epoch=10, cpu_count=8).config.trainer
    assert t.default_local_dir == "checkpoints/p/b" and t.log_dir == "outputs/p/b"
    assert t.cpus_per_worker == 8  # 8 cores / 1 worker per node, not the default 2 workers' 4
    assert (t.call_timeout_s, t.collective_timeout_s) == (1800, 600)  # trainer.device=cpu's defaults
    assert cfg.trainer.default_local_dir is None  # the user's config is left as loaded


def test_user_values_are_kept_not_overwritten():
    cfg = load_config(
        RunConfig,
        None,
        [
            "trainer.default_local_dir=/ck",
            "trainer.log_dir=/lg",
            "trainer.cpus_per_worker=3",
            "actor.optim.total_training_steps=100",
            "trainer.total_training_steps=7",
            "trainer.call_timeout_s=90",
        ],
    )
    run = resolve_here(cfg, steps_per_epoch=10, cpu_count=2)
    t = run.config.trainer
    assert (t.default_local_dir, t.log_dir, t.cpus_per_worker) == ("/ck", "/lg", 3)
    assert (t.call_timeout_s, t.collective_timeout_s) == (90, 600)
    assert run.config.actor.optim.total_training_steps == 100  # part of a longer LR schedule, on purpose
    assert run.total_steps == 7 and t.total_epochs == 1


@pytest.mark.parametrize(
    "overrides, steps, epochs",
    [
        ([], 10, 1),
        (["trainer.total_epochs=3"], 30, 3),
        (["trainer.total_training_steps=25"], 25, 3),
        (["trainer.total_training_steps=15", "trainer.total_epochs=2"], 15, 2),
    ],
)
def test_run_length_and_lr_schedule_derive_from_steps_or_epochs(overrides, steps, epochs):
    cfg = load_config(RunConfig, None, ["algorithm.adv_estimator=gae", "trainer.total_training_steps=null", *overrides])
    run = resolve_here(cfg, steps_per_epoch=10)
    assert (run.total_steps, run.config.trainer.total_epochs) == (steps, epochs)
    assert run.config.actor.optim.total_training_steps == steps
    assert run.config.critic.optim.total_training_steps == steps


def test_steps_that_do_not_fit_the_epochs_name_both_keys():
    cfg = load_config(RunConfig, None, ["trainer.total_training_steps=25", "trainer.total_epochs=2"])
    with pytest.raises(ConfigError, match=r"trainer.total_training_steps=25 does not fit in trainer.total_epochs=2"):
        resolve_here(cfg, steps_per_epoch=10)


def test_rollout_lengths_and_critic_derive_and_the_result_is_frozen():
    cfg = load_config(RunConfig, None, ["data.max_response_length=48", "algorithm.adv_estimator=gae"])
    run = resolve_here(cfg, steps_per_epoch=4)
    c = run.config
    assert (c.rollout.prompt_length, c.rollout.response_length) == (c.data.max_prompt_length, 48)
    assert c.critic.enable is True and c.critic.model == c.model
    # CPU defaults: one rank per shard group, whose gathered copy of the weights is freed after forward
    assert c.actor.engine.fsdp_size == 1 and c.actor.engine.reshard_after_forward is True
    assert run.roles == ("actor", "rollout", "critic")
    with pytest.raises(FrozenConfigError, match="read-only"):
        c.trainer.log_dir = "elsewhere"
    with pytest.raises(FrozenConfigError):
        c.actor.optim.lr = 1.0
    cfg.trainer.log_dir = "still/editable"  # the loaded config is the user's, not frozen


def test_worker_sets_follow_the_placement():
    split = resolve_here(
        load_config(
            RunConfig,
            None,
            [
                "trainer.placement=split",
                "trainer.n_workers_per_node=4",
                "algorithm.adv_estimator=gae",
                "actor.use_kl_loss=true",
            ],
        ),
        4,
    )
    assert [(s.pool, s.world_size, s.roles) for s in split.worker_sets] == [
        (0, 2, ("actor", "rollout")),
        (1, 2, ("ref", "critic")),
    ]
    assert split.set_of("critic").pool == 1 and split.set_of("reward_model") is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.response_length=64", "data.max_response_length=32"],
            r"rollout.response_length=64 conflicts with data.max_response_length=32",
        ),
        (
            ["actor.policy_loss.tis_imp_ratio_cap=2.0", "rollout.calculate_log_probs=false"],
            r"tis_imp_ratio_cap=2.0 .*rollout.calculate_log_probs=false",
        ),
        (["ref.param_dtype=fp16"], r"ref.param_dtype must be one of \['bf16', 'fp32', 'auto'\]"),
        (["trainer.experiment_name=a/b"], r"trainer.experiment_name names a directory level"),
        (["actor.loss_agg_mode=sum"], r"actor.loss_agg_mode='sum' is unknown; valid: \[.*'token-mean'"),
        (["trainer.device=cuda"], r"trainer.device=cuda but torch sees no CUDA device"),
        (["rollout.name=vllm"], r"rollout.name=vllm needs the vllm package"),
        (["actor.lora.rank=8", "rollout.name=vllm"], r"actor.lora.rank=8 with rollout.name=vllm is not supported"),
        (["actor.lora.target_modules=q_proj"], r"lora.target_modules must be 'all-linear' or a non-empty list"),
    ],
)
def test_cross_section_problems_are_refused_at_load(overrides, message):
    pytest.importorskip("torch")
    import importlib.util

    import torch

    if "trainer.device=cuda" in overrides and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if "rollout.name=vllm" in overrides and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, overrides)


def test_lora_settings_load_from_overrides():
    cfg = load_config(
        RunConfig, None, ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=[q_proj,v_proj]"]
    )
    assert cfg.actor.lora.enabled and cfg.actor.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.actor.lora.alpha == 16 and not load_config(RunConfig, None, []).actor.lora.enabled


def test_fsdp_size_that_does_not_divide_the_role_world_is_refused():
    cfg = load_config(RunConfig, None, ["actor.engine.fsdp_size=3"])
    with pytest.raises(ConfigError, match=r"actor.engine.fsdp_size=3 must divide the number of ranks \(2\)"):
        resolve_here(cfg, steps_per_epoch=4)


def test_dead_engine_field_is_gone():
    with pytest.raises(ConfigError, match="unknown config key 'actor.engine.micro_batch_size_per_device'"):
        load_config(RunConfig, None, ["actor.engine.micro_batch_size_per_device=4"])


def test_step_plan():
    run = resolve_here(
        load_config(
            RunConfig,
            None,
            [
                "algorithm.adv_estimator=gae",
                "trainer.critic_warmup=1",
                "trainer.total_training_steps=4",
                "trainer.test_freq=3",
                "trainer.save_freq=2",
                "algorithm.use_kl_in_reward=true",
            ],
        ),
        10,
    )
    plans = [plan_step(run, s) for s in range(1, 5)]
    assert [p.update_actor for p in plans] == [False, True, True, True]
    assert all(p.update_critic and p.values and p.ref_log_prob and p.old_log_prob for p in plans)
    assert [p.validate for p in plans] == [False, False, True, True]  # every 3rd and the last
    assert [p.save for p in plans] == [False, True, False, True]
    grpo = resolve_here(load_config(RunConfig, None, ["actor.ppo_mini_batch_size=8"]), 10)  # one optimizer step
    first = plan_step(grpo, 1)
    assert not (first.old_log_prob or first.ref_log_prob or first.values or first.update_critic)


def _fake_checkpoint(root: Path, run: str) -> Path:
    path = root / "global_step_2"
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"global_step": 2, "run": run}))
    write_manifest(path, 2)  # a checkpoint without its manifest is damaged, and skipped
    (path / "COMPLETE").write_text("")
    return path


def test_two_experiments_never_share_a_directory_and_auto_resume_never_crosses_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = resolve_here(load_config(RunConfig, None, ["trainer.experiment_name=a"]), 4).config
    b = resolve_here(load_config(RunConfig, None, ["trainer.experiment_name=b"]), 4).config
    assert a.trainer.default_local_dir != b.trainer.default_local_dir and a.trainer.log_dir != b.trainer.log_dir
    ckpt = _fake_checkpoint(Path(a.trainer.default_local_dir), "hybridflow/a")
    assert resume_path(a) == ckpt
    assert resume_path(b) is None  # its own directory is empty
    shared = resolve_here(
        load_config(
            RunConfig, None, ["trainer.experiment_name=b", f"trainer.default_local_dir={a.trainer.default_local_dir}"]
        ),
        4,
    )
    with pytest.raises(ValueError, match=r"holds checkpoints of run 'hybridflow/a', but this run is 'hybridflow/b'"):
        resume_path(shared.config)


def test_sequence_parallel_layout_is_checked_against_the_model_and_the_workers():
    """SmolLM2 has 9 heads and 3 kv heads: sp=2 resolves on 2 workers (kv groups split 2 + 1, one dp group), sp=4
    too (kv heads repeated for their q heads), sp=16 is refused with the numbers, as are sp not dividing the
    workers, sp with tp, and mini-batches that do not split over the dp groups."""
    ok = resolve_here(
        load_config(RunConfig, None, ["actor.engine.ulysses_sequence_parallel_size=2"]), steps_per_epoch=4
    )
    assert ok.config.actor.engine.ulysses_sequence_parallel_size == 2 and ok.config.actor.engine.fsdp_size == 1
    sp4 = ["actor.engine.ulysses_sequence_parallel_size=4", "trainer.n_workers_per_node=4"]
    assert resolve_here(load_config(RunConfig, None, sp4), steps_per_epoch=4).config.actor.engine.dp_size(4) == 1
    sp16 = ["actor.engine.ulysses_sequence_parallel_size=16", "trainer.n_workers_per_node=16"]
    with pytest.raises(
        ConfigError,
        match=r"actor.engine.ulysses_sequence_parallel_size=16 must be at most "
        r"num_attention_heads \(9\).*9 attention heads and 3 kv heads",
    ):
        resolve_here(load_config(RunConfig, None, sp16), steps_per_epoch=4)
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=2 must divide the number of ranks \(3\)"):
        resolve_here(
            load_config(
                RunConfig,
                None,
                ["actor.engine.ulysses_sequence_parallel_size=2", "trainer.n_workers_per_node=3", "rollout.n=6"],
            ),
            steps_per_epoch=4,
        )
    with pytest.raises(ConfigError, match=r"critic.engine.ulysses_sequence_parallel_size=16 must be at most"):
        resolve_here(
            load_config(
                RunConfig,
                None,
                [
                    "critic.engine.ulysses_sequence_parallel_size=16",
                    "algorithm.adv_estimator=gae",
                    "trainer.n_workers_per_node=16",
                ],
            ),
            steps_per_epoch=4,
        )
    lora = resolve_here(
        load_config(RunConfig, None, ["actor.engine.ulysses_sequence_parallel_size=2", "actor.lora.rank=4"]),
        steps_per_epoch=4,
    )
    assert lora.config.actor.lora.rank == 4
    both = ["actor.engine.ulysses_sequence_parallel_size=2", "actor.engine.tensor_parallel_size=2"]
    assert load_config(RunConfig, None, [*both, "trainer.n_workers_per_node=4"]).actor.engine.ranks_per_dp_group == 4
    with pytest.raises(ConfigError, match=r"= 6 responses must divide evenly over 4 dp groups \(8 workers / 2 actor"):
        load_config(
            RunConfig,
            None,
            [
                "actor.engine.ulysses_sequence_parallel_size=2",
                "trainer.n_workers_per_node=8",
                "actor.ppo_mini_batch_size=2",
                "data.train_batch_size=2",
                "rollout.n=3",
            ],
        )


def test_critic_mini_batches_are_checked_only_when_there_is_a_critic():
    """GRPO on 3 workers: the critic's default mini-batch (4 x 8 = 32 responses) would not split over 3, but
    there is no critic; with gae it is refused naming the critic."""
    grpo = ["trainer.n_workers_per_node=3", "actor.ppo_mini_batch_size=3", "data.train_batch_size=6"]
    assert load_config(RunConfig, None, grpo).world_size == 3
    with pytest.raises(ConfigError, match=r"critic.ppo_mini_batch_size \(4\) \* rollout.n \(8\) = 32 responses"):
        load_config(
            RunConfig,
            None,
            [
                *grpo,
                "algorithm.adv_estimator=gae",
                "critic.ppo_mini_batch_size=4",
                "data.train_batch_size=12",
                "actor.ppo_mini_batch_size=3",
            ],
        )


def test_tensor_parallel_layout_is_checked_against_the_model_and_the_workers():
    """SmolLM2 (the default model) has 9 attention heads and 3 kv heads: tp=2 is refused with the numbers,
    tp=3 on 3 workers resolves (one dp group); tp that does not divide the workers and tp with LoRA are refused."""
    with pytest.raises(
        ConfigError,
        match=r"actor.engine.tensor_parallel_size=2 must divide num_attention_heads "
        r"\(9\), num_key_value_heads \(3\)",
    ):
        resolve_here(load_config(RunConfig, None, ["actor.engine.tensor_parallel_size=2"]), steps_per_epoch=4)
    tp3 = ["actor.engine.tensor_parallel_size=3", "trainer.n_workers_per_node=3", "rollout.n=6"]
    ok = resolve_here(load_config(RunConfig, None, tp3), steps_per_epoch=4)
    assert ok.config.actor.engine.tensor_parallel_size == 3 and ok.config.actor.engine.fsdp_size == 1
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 must divide the number of ranks \(2\)"):
        resolve_here(load_config(RunConfig, None, ["actor.engine.tensor_parallel_size=3"]), steps_per_epoch=4)
    with pytest.raises(ConfigError, match=r"rollout.tensor_model_parallel_size=2 must divide num_attention_heads"):
        resolve_here(load_config(RunConfig, None, ["rollout.tensor_model_parallel_size=2"]), steps_per_epoch=4)
    with pytest.raises(ConfigError, match="does not combine with actor.lora.rank > 0"):
        resolve_here(load_config(RunConfig, None, [*tp3, "actor.lora.rank=4"]), steps_per_epoch=4)


def test_reshard_after_forward_defaults_to_freeing_memory_except_across_cpu_ranks():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    engine = EngineConfig()
    assert engine.resolve_reshard_after_forward(cpu, 1) is True  # a local copy: free it
    assert engine.resolve_reshard_after_forward(cpu, 2) is False  # a gloo gather in backward costs more
    assert engine.resolve_reshard_after_forward(cuda, 2) is True
    assert EngineConfig(reshard_after_forward=False).resolve_reshard_after_forward(cpu, 1) is False
