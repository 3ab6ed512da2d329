"""verl's run scripts load unchanged: renamed keys, warned GPU-only keys, refused missing features, verl's defaults.

The fixtures (tests/verl_scripts.py) are ten of verl's own example command lines, model/data/rollout swapped for
local ones; the expectations below are written by hand from the scripts and verl's ppo_trainer.yaml. Every key of
verl's full generated config (tests/data/verl_ppo_trainer_b178a3c.yaml) must be in the table or be hybridflow's.
"""

from __future__ import annotations

import logging
import sys
from functools import reduce
from pathlib import Path

import pytest
import yaml

from hybridflow.compat.verl import keys as verl_keys
from hybridflow.compat.verl.dialect import flatten, lookup, nest
from hybridflow.compat.verl.doc import render
from hybridflow.config.run import RunConfig
from hybridflow.models import tiny_model_dir
from hybridflow.utils.config_loader import ConfigError, load_config, to_yaml, unknown_keys

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_cli import read_metrics, run_cli  # noqa: E402
from verl_scripts import SCRIPTS, local  # noqa: E402

MODEL = str(tiny_model_dir("llama"))
TASKS = "/tmp/hybridflow-verl-tests"
VERL_GENERATED = Path(__file__).parent / "data" / "verl_ppo_trainer_b178a3c.yaml"
"""verl's full config with every default, as verl generates it (verl/trainer/config/_generated_ppo_trainer.yaml)."""

EXPECTED: dict[str, dict[str, object]] = {
    "quickstart": {
        "algorithm.adv_estimator": "gae",  # verl's default: the quickstart is PPO with a critic
        "rollout.n": 1,
        "data.train_batch_size": 256,
        "actor.ppo_mini_batch_size": 64,
        "actor.ppo_micro_batch_size_per_device": 4,
        "actor.log_prob_micro_batch_size_per_device": 8,
        "ref.log_prob_micro_batch_size_per_device": 4,
        "critic.ppo_micro_batch_size_per_device": 4,
        "critic.ppo_mini_batch_size": 64,  # verl: the critic's mini-batch follows the actor's
        "critic.optim.lr": 1e-5,
        "actor.optim.lr": 1e-6,
        "trainer.logger": ["console"],
        "trainer.val_before_train": False,
        "trainer.n_workers_per_node": 1,
        "trainer.total_epochs": 15,
        "trainer.total_training_steps": None,
        "trainer.test_freq": 10,
        "rollout.gpu_memory_utilization": 0.4,
        "use_critic": True,
    },
    "grpo_qwen2_7b": {
        "algorithm.adv_estimator": "grpo",
        "rollout.n": 5,
        "data.train_batch_size": 1024,
        "actor.ppo_mini_batch_size": 256,
        "actor.ppo_micro_batch_size_per_device": 40,
        "actor.use_kl_loss": True,
        "actor.engine.gradient_checkpointing": True,
        "actor.log_prob_micro_batch_size_per_device": 40,
        "ref.log_prob_micro_batch_size_per_device": 40,
        "rollout.tensor_model_parallel_size": 2,
        "trainer.logger": ["console", "wandb"],
        "trainer.n_workers_per_node": 8,
        "use_critic": False,
    },
    "grpo_deepseek7b": {"trainer.logger": ["console"], "actor.log_prob_micro_batch_size_per_device": 160},
    "ppo_deepseek7b": {
        "algorithm.adv_estimator": "gae",
        "critic.ppo_mini_batch_size": 256,
        "critic.ppo_micro_batch_size_per_device": 32,
        "critic.engine.gradient_checkpointing": True,
        "critic.model.path": MODEL,
        "rollout.tensor_model_parallel_size": 4,
        "rollout.n": 1,
    },
    "rloo_qwen2_7b": {"algorithm.adv_estimator": "rloo", "algorithm.use_kl_in_reward": True, "rollout.n": 5},
    "reinforce_pp_qwen2_7b_math": {
        "algorithm.adv_estimator": "reinforce_plus_plus",
        "actor.optim.lr": 3e-6,
        "actor.ppo_mini_batch_size": 1024,
        "actor.kl_loss_type": "mse",
        "trainer.n_workers_per_node": 16,
    },
    "grpo_lora_qwen2_5_3b": {
        "actor.lora.rank": 64,
        "actor.lora.alpha": 32.0,
        "data.shuffle": False,
        "data.train_batch_size": 16,
        "trainer.n_workers_per_node": 2,
    },
    "grpo_seq_balance_qwen2_7b": {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 24000},
    "ppo_seq_balance_qwen2_7b": {
        "actor.use_dynamic_bsz": True,
        "critic.use_dynamic_bsz": True,  # verl: follows the actor's
        "critic.ppo_max_token_len_per_gpu": 98304,
        "actor.log_prob_max_token_len_per_gpu": 24000,
        "critic.ppo_mini_batch_size": 512,
    },
    "ppo_gemma": {"actor.engine.use_remove_padding": False, "critic.engine.gradient_checkpointing": False},
}


def value(cfg: RunConfig, key: str) -> object:
    return reduce(getattr, key.split("."), cfg)


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def ignored(messages: list[str]) -> dict[str, str]:
    """The summaries of keys accepted without effect: key -> the reason line naming it (each key once)."""
    out: dict[str, str] = {}
    for message in messages:
        if "of verl's keys change nothing here (by reason):" in message:
            for line in message.splitlines()[1:]:
                why, _, keys = line.strip().rpartition(": ")
                for item in keys.split(", "):
                    key = item.partition("=")[0]
                    assert key not in out, (key, message)
                    out[key] = why
    return out


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_verl_scripts_load_with_verl_meaning(name: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hybridflow.config"):
        cfg = load_config(RunConfig, None, local(name, MODEL, TASKS))
    assert cfg.model.path == MODEL and cfg.trainer.total_training_steps is None and cfg.trainer.total_epochs == 15
    for key, want in EXPECTED[name].items():
        assert value(cfg, key) == want, (key, value(cfg, key), want)
    gpu_only = [line for line in SCRIPTS[name].split() if lookup(verl_keys.NO_EFFECT, line.split("=")[0])]
    messages = warned(caplog)
    summary = ignored(messages)  # one warning for them all, a line per reason naming its keys
    for line in gpu_only:
        key = line.split("=")[0]
        assert summary[key] == f"no effect here: {lookup(verl_keys.NO_EFFECT, key)}"
    workers = [m for m in messages if "trainer.n_gpus_per_node=" in m and "worker processes here" in m]
    memory = [m for m in messages if "rollout.gpu_memory_utilization=" in m and "only vllm on a GPU" in m]
    assert len(workers) == 1 and len(memory) == 1, messages  # the fixtures run the native rollout on CPU
    assert len(messages) == bool(gpu_only) + 2, messages
    assert any("starts from verl's defaults" in r.getMessage() for r in caplog.records)


def test_every_no_effect_key_is_accepted_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    keys = sorted(k for k in verl_keys.NO_EFFECT if "*" not in k)  # all in one run: a load costs ~1 s
    with caplog.at_level(logging.WARNING, logger="hybridflow.config"):
        load_config(RunConfig, None, [f"{key}=true" for key in keys] + [f"data.task_dir={TASKS}"])
    messages = warned(caplog)
    assert len(messages) == 1 and messages[0].startswith(f"command-line overrides: {len(keys)} of verl's keys")
    assert ignored(messages) == {key: f"no effect here: {verl_keys.NO_EFFECT[key]}" for key in keys}
    assert all(f" {key}=True" in messages[0] for key in keys)


def test_every_missing_feature_and_unknown_key_is_reported_at_once() -> None:
    refused = [k for k in verl_keys.NOT_YET if "*" not in k]
    bad = [f"{k}=7" for k in refused] + [
        "actor_rollout_ref.actor.ppo_epoch=2",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "rollout.log_prob_micro_batch_size_per_gpu=2",  # verl's key without its actor_rollout_ref. prefix
        "data.train_batch_sizes=3",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, bad)
    lines = str(err.value).splitlines()
    assert lines[0] == f"{len(bad)} config keys are wrong:" and len(lines) == len(bad) + 1
    for key in refused:
        assert any(f"{key!r} is verl's; hybridflow has no {verl_keys.NOT_YET[key]} yet" in line for line in lines), key
    text = str(err.value)
    assert "'actor_rollout_ref.actor.ppo_epoch' is not one of verl's keys" in text
    assert "did you mean 'actor_rollout_ref.actor.ppo_epochs' ('actor.ppo_epochs' here)?" in text
    assert "'actor.ppo_micro_batch_size_per_gpu'; 'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu' is " in text
    assert "'actor.ppo_micro_batch_size_per_device' here" in text
    assert (
        "unknown config key 'rollout.log_prob_micro_batch_size_per_gpu'; "
        "'actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu' is 'actor.log_prob_micro_batch_size_per_device' "
        "here" in text
    )
    assert "unknown config key 'data.train_batch_sizes'; did you mean ['data.train_batch_size', " in text


def test_a_feature_switched_off_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hybridflow.config"):
        load_config(RunConfig, None, ["trainer.del_local_ckpt_after_load=false", f"data.task_dir={TASKS}"])
    assert ignored(warned(caplog)) == {
        "trainer.del_local_ckpt_after_load": "accepted: hybridflow has no deleting a checkpoint after loading "
        "it, which this value leaves off"
    }


def test_hybridflow_names_keep_hybridflow_defaults() -> None:
    assert to_yaml(load_config(RunConfig)) == to_yaml(RunConfig())
    cfg = load_config(RunConfig, None, ["trainer.logger=console", "rollout.n=4"])
    assert cfg.trainer.logger == ["console"] and cfg.trainer.total_training_steps == 40
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.critic.ppo_mini_batch_size == 4


def test_verl_yaml_file_is_translated_too(tmp_path: Path) -> None:
    config = tmp_path / "verl.yaml"
    config.write_text(
        f"actor_rollout_ref:\n  model: {{path: {MODEL}, lora_rank: 4}}\n  rollout: {{n: 2, dtype: bfloat16}}\n"
        "  actor: {ppo_mini_batch_size: 128, optim: {total_training_steps: -1}}\n"
        "algorithm: {adv_estimator: grpo}\n"
    )
    cfg = load_config(RunConfig, config, ["data.train_batch_size=256"])
    assert cfg.actor.lora.rank == 4 and cfg.rollout.n == 2 and cfg.rollout.dtype == "bf16"
    assert cfg.actor.optim.total_training_steps is None and cfg.trainer.total_epochs == 30


def test_mini_batch_that_does_not_divide_the_batch_says_why() -> None:
    with pytest.raises(ConfigError, match=r"equal mini-batches .*last, smaller one of 64 prompts"):
        load_config(
            RunConfig,
            None,
            [
                "data.train_batch_size=1024",
                "actor_rollout_ref.actor.ppo_mini_batch_size=80",
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.rollout.n=2",
            ],
        )


def test_docs_page_is_generated_from_the_table() -> None:
    page = Path(__file__).parents[1] / "docs" / "verl.md"
    assert page.read_text() == render(), "run: python -m hybridflow.compat.verl.doc > docs/verl.md"


def test_print_config_shows_hybridflow_names_and_the_verl_defaults(tmp_path: Path) -> None:
    args = local("quickstart", MODEL, str(tmp_path / "data"), gen_train_size=256)
    proc = run_cli(["--print-config", *args], tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = yaml.safe_load(proc.stdout)
    assert "actor_rollout_ref" not in printed and printed["model"]["path"] == MODEL
    assert printed["trainer"]["total_training_steps"] == 15 and printed["critic"]["ppo_mini_batch_size"] == 64
    assert "this run starts from verl's defaults" in proc.stderr and "algorithm.adv_estimator=gae" in proc.stderr


PRINTED_ONLY_BY_LOAD = ("use_critic", "trainer.total_training_steps", "critic.model.path")
"""EXPECTED keys the printed run does not repeat as loaded: use_critic is derived, the step count is resolved from
the epochs (checked on its own), and the critic's model path is MODEL_KV4 here."""
MODEL_KV4 = str(tiny_model_dir("llama", num_kv_heads=4))
"""ppo_deepseek7b's rollout.tensor_model_parallel_size=4 must divide the model's kv heads (MODEL has 2)."""


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_verl_script_prints_its_run(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each script through `hybridflow train --print-config` (load, read the data, measure, resolve): exit 0, the
    run under hybridflow's names with the script's values, and verl's run length (epochs x batches per epoch)."""
    from hybridflow.cli.main import main

    monkeypatch.chdir(tmp_path)
    rows = 4096  # at least one batch of every script (ppo_seq_balance: 4096 prompts)
    assert main(["train", "--print-config", *local(name, MODEL_KV4, TASKS, gen_train_size=rows)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert "actor_rollout_ref" not in printed and printed["model"]["path"] == MODEL_KV4
    flat = flatten(printed)
    for key, want in EXPECTED[name].items():
        if key not in PRINTED_ONLY_BY_LOAD:
            assert flat[key] == want, (key, flat[key], want)
    batches = rows // flat["data.train_batch_size"]
    assert flat["trainer.total_epochs"] == 15 and flat["trainer.total_training_steps"] == 15 * batches


def two_steps(name: str, tmp_path: Path) -> list[dict]:
    """verl script `name`, shrunk to 2 steps of 2 prompts on the local backend: both steps train the actor."""
    small = [
        "data.train_batch_size=2",
        "data.max_prompt_length=128",
        "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.backend=local",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.log_dir={tmp_path / 'logs'}",
    ]
    args = local(name, MODEL, str(tmp_path / "data"), gen_train_size=16)
    proc = run_cli([*args, *small, "trainer.n_gpus_per_node=1"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    return rows


def test_a_verl_script_trains_two_steps_on_the_local_backend(tmp_path: Path) -> None:
    two_steps("grpo_deepseek7b", tmp_path)


@pytest.mark.slow  # as long as the GRPO run above (72 s vs 74 s side by side on a busy 2-core machine)
def test_verls_ppo_quickstart_trains_its_critic_two_steps(tmp_path: Path) -> None:
    rows = two_steps("quickstart", tmp_path)  # PPO: GAE with a critic
    assert [r["step"] for r in rows if "critic/vf_loss" in r] == [1, 2]


def verl_generated() -> dict[str, object]:
    """Every leaf key of verl's generated config with its default."""
    return flatten(yaml.safe_load(VERL_GENERATED.read_text()))


def classified(key: str) -> bool:
    return key in verl_keys.SETS or any(
        lookup(table, key) is not None for table in (verl_keys.RENAMED, verl_keys.NO_EFFECT, verl_keys.NOT_YET)
    )


def test_every_key_of_verls_generated_config_is_classified() -> None:
    keys = verl_generated()
    assert len(keys) == 556
    unclassified = [k for k, v in keys.items() if not classified(k) and unknown_keys(RunConfig, nest({k: v}))]
    assert unclassified == [], f"{len(unclassified)} verl keys are in no table and not hybridflow's: {unclassified}"
    renamed_to_nothing = [k for k, mine in verl_keys.RENAMED.items() if unknown_keys(RunConfig, nest({mine: None}))]
    assert renamed_to_nothing == []
    assert [
        k for k in verl_keys.ACCEPTED if lookup(verl_keys.NOT_YET, k) is None
    ] == []  # accepted values only of refused keys


def test_print_config_warns_about_verls_profiler_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridflow.cli.main import main

    profiler = {
        k: v
        for k, v in verl_generated().items()
        if k.startswith(("global_profiler.", f"{verl_keys.A}.actor.profiler."))
    }
    config = tmp_path / "profiler.yaml"
    config.write_text(yaml.safe_dump(nest(profiler)))
    monkeypatch.chdir(tmp_path)
    args = local("quickstart", MODEL, str(tmp_path / "data"), gen_train_size=256)
    with caplog.at_level(logging.WARNING, logger="hybridflow.config"):
        assert main(["train", "--print-config", "--config", str(config), *args]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["total_training_steps"] == 15
    summary = ignored(warned(caplog))
    for key in profiler:  # every key named once, with the reason
        assert summary[key].startswith("no effect here: "), key
    assert any("verl's profilers (nsys, npu, torch, torch_memory)" in why for why in summary.values())


def test_verl_values_that_are_what_hybridflow_does_are_accepted(caplog: pytest.LogCaptureFixture) -> None:
    accepted = [
        "actor_rollout_ref.actor.optim.optimizer=AdamW",
        "critic.optim.num_cycles=0.5",
        "actor_rollout_ref.actor.router_replay.mode=disabled",
        "actor_rollout_ref.model.mtp.enable=false",
        "actor_rollout_ref.model.mtp.speculative_algorithm=EAGLE",  # a setting of mtp: no effect while it is off
        "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "critic._target_=verl.workers.config.FSDPCriticConfig",  # every Hydra class path: one rule
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "custom_reward_function.name=my_score",
        f"data.task_dir={TASKS}",
    ]
    with caplog.at_level(logging.WARNING, logger="hybridflow.config"):
        cfg = load_config(RunConfig, None, accepted)
    assert cfg.actor.engine.param_dtype == "fp32" and cfg.reward.custom_reward_function.name == "my_score"
    assert cfg.algorithm.rollout_is is True and cfg.algorithm.rollout_is_level == "sequence"
    summary = ignored(warned(caplog))  # one warning
    assert len(warned(caplog)) == 1 and len(summary) == 6, warned(caplog)
    assert summary["critic._target_"] == f"no effect here: {verl_keys.NO_EFFECT['*._target_']}"
    refused = ["actor_rollout_ref.actor.optim.optimizer=SGD", "algorithm.rollout_correction.rollout_is=geometric"]
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, refused)
    assert "hybridflow has no optimizers other than AdamW yet" in str(err.value)
    assert "rollout_is='geometric' is not one of the values hybridflow reads: [None, 'token', 'sequence']" in str(
        err.value
    )
