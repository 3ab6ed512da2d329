"""verl's whole generated config file loads: `${...}` resolved as Hydra would, verl's defaults accepted with one
summary, and what truly changes behaviour refused, every problem in one message.

The expectations are written by hand from tests/data/verl_ppo_trainer_b178a3c.yaml (verl's generated
ppo_trainer.yaml at commit b178a3c).
"""

from __future__ import annotations

import logging
from functools import reduce
from pathlib import Path

import pytest

from hybridflow.config.run import RunConfig
from hybridflow.models import tiny_model_dir
from hybridflow.utils.config_loader import ConfigError, load_config

MODEL = str(tiny_model_dir("llama"))
VERL_GENERATED = Path(__file__).parent / "data" / "verl_ppo_trainer_b178a3c.yaml"
LOCAL = [  # what a verl user changes in any case: the model, the data; the device where there is no GPU
    f"actor_rollout_ref.model.path={MODEL}",
    "actor_rollout_ref.rollout.name=native",
    "data.train_files=null",
    "data.val_files=null",
    "data.task_dir=/tmp/hybridflow-verl-tests",
    "trainer.device=cpu",
]


def value(cfg: RunConfig, key: str) -> object:
    return reduce(getattr, key.split("."), cfg)


def summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "of verl's keys change nothing here" in r.getMessage()]


def test_verls_whole_generated_config_loads_with_verls_values(caplog: pytest.LogCaptureFixture) -> None:
    overrides = [
        *LOCAL,
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",  # the critic's follows: ${oc.select:...ppo_mini_batch_size}
        "data.max_prompt_length=256",  # the rollout's prompt_length follows: ${oc.select:data.max_prompt_length,512}
        "trainer.project_name=p",  # default_local_dir: checkpoints/${trainer.project_name}/${trainer.experiment_name}
    ]
    with caplog.at_level(logging.WARNING, logger="hybridflow.config"):
        cfg = load_config(RunConfig, VERL_GENERATED, overrides)
    defaults = RunConfig()
    expected = {
        "algorithm.adv_estimator": "gae",
        "algorithm.gamma": 1.0,
        "algorithm.lam": 1.0,
        "algorithm.kl_ctrl.kl_coef": 0.001,
        "algorithm.rollout_is": False,  # rollout_correction.rollout_is: null
        "algorithm.rollout_is_threshold": 2.0,
        "data.train_batch_size": 1024,
        "data.seed": defaults.data.seed,  # verl's null: not set
        "rollout.n": 1,
        "rollout.prompt_length": 256,
        "rollout.response_length": 512,
        "rollout.temperature": 1.0,
        "rollout.top_k": -1,
        "rollout.multi_turn.max_assistant_turns": 1_000_000,  # verl's null: no limit
        "actor.ppo_mini_batch_size": 64,
        "actor.ppo_micro_batch_size_per_device": defaults.actor.ppo_micro_batch_size_per_device,  # null: not set
        "actor.optim.lr": 1e-6,
        "actor.optim.lr_scheduler": "constant",  # warmup_style: null does not overwrite lr_scheduler_type
        "actor.optim.total_training_steps": None,  # -1
        "actor.optim.lr_warmup_steps": -1,  # the ratio decides
        "critic.optim.lr_warmup_steps": -1,
        "actor.use_kl_loss": False,
        "actor.kl_loss_coef": 0.001,
        "actor.policy_loss.clip_ratio": 0.2,
        "critic.ppo_mini_batch_size": 64,
        "critic.ppo_epochs": 1,
        "critic.optim.lr": 1e-5,
        "critic.optim.total_training_steps": None,
        "critic.model.tokenizer_path": MODEL,  # ${oc.select:actor_rollout_ref.model.path,...}: the override's value
        "reward_model.enable": False,
        "reward_model.input_tokenizer": MODEL,  # ${actor_rollout_ref.model.path}
        "trainer.total_epochs": 30,
        "trainer.total_training_steps": None,
        "trainer.n_workers_per_node": 8,
        "trainer.default_local_dir": "checkpoints/p/gsm8k",
        "trainer.logger": ["console", "wandb"],
    }
    assert {k: value(cfg, k) for k in expected} == expected
    messages = [r.getMessage() for r in caplog.records]
    assert not any("only vllm on a GPU" in m for m in messages)  # the file's rollout.name is ??? (set elsewhere)
    (summary,) = summaries(caplog)  # ONE warning names every key that changes nothing, a line per reason
    assert int(summary.split(": ")[1].split()[0]) > 400
    for item in (
        "global_profiler.tool=null",
        'actor_rollout_ref.actor.checkpoint.save_contents=["model","optimizer","extra"]',
        "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs",
        "data.image_key=images",
        "critic.data_loader_seed=42",
        "actor_rollout_ref.rollout.mtp.enable=False",  # ${oc.select:actor_rollout_ref.model.mtp, null}: a mapping
    ):
        assert f" {item}" in summary, item


def test_values_that_change_behaviour_are_refused_at_once() -> None:
    refused = [
        "data.image_key=pixels",
        "critic.data_loader_seed=7",
        "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, VERL_GENERATED, [*LOCAL, *refused, "data.train_batch_size=lots"])
    lines = str(err.value).splitlines()
    # + the file's load_contents (${.save_contents} follows the override, as in Hydra) + the bad value
    assert lines[0] == f"{len(refused) + 2} config keys are wrong:", lines
    assert "bad value for config key 'data.train_batch_size'" in lines[-1]
    for key in [r.split("=")[0] for r in refused] + ["actor_rollout_ref.actor.checkpoint.load_contents"]:
        assert any(f"{key!r} is verl's; hybridflow has no " in line for line in lines), key


def test_reward_model_input_tokenizer_other_than_the_policys_is_refused() -> None:
    rm = ["reward_model.enable=true", f"reward_model.model.path={MODEL}"]
    cfg = load_config(RunConfig, VERL_GENERATED, [*LOCAL, *rm])
    assert cfg.reward_model.input_tokenizer == MODEL  # verl's default: the policy's path
    with pytest.raises(ConfigError, match="reward_model.input_tokenizer='/other/tokenizer' .* is not the policy's"):
        load_config(RunConfig, VERL_GENERATED, [*LOCAL, *rm, "reward_model.model.input_tokenizer=/other/tokenizer"])
    off = load_config(RunConfig, None, ["reward_model.model.input_tokenizer=/other/tokenizer"])
    assert off.reward_model.input_tokenizer == "/other/tokenizer"  # the reward model is off: nothing to score


def test_lr_warmup_steps_keep_verls_meaning() -> None:
    from hybridflow.engine.optim import warmup_steps

    cfg = load_config(
        RunConfig,
        VERL_GENERATED,
        [
            *LOCAL,
            "actor_rollout_ref.actor.optim.lr_warmup_steps=5",  # > 0: wins over the ratio
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5",
            "actor_rollout_ref.actor.optim.total_training_steps=40",
            "critic.optim.lr_warmup_steps=0",  # 0: the ratio decides (verl's documented meaning)
            "critic.optim.lr_warmup_steps_ratio=0.25",
            "critic.optim.total_training_steps=40",
        ],
    )
    assert (cfg.actor.optim.lr_warmup_steps, cfg.critic.optim.lr_warmup_steps) == (5, 0)
    assert warmup_steps(cfg.actor.optim) == 5 and warmup_steps(cfg.critic.optim) == 10  # 0.25 * 40


def test_print_config_of_verls_whole_file_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml

    from hybridflow.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(VERL_GENERATED), "--print-config", *LOCAL, "data.gen_train_size=2048"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algorithm"]["adv_estimator"] == "gae" and printed["critic"]["enable"] is True
    assert printed["trainer"]["total_epochs"] == 30 and printed["trainer"]["total_training_steps"] == 60  # 2 a epoch
