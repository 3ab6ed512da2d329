"""docs/extending.md cannot rot: every python block runs, and the names it registers pass the config's checks
under the keys the page says select them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridflow.config.run import RunConfig
from hybridflow.utils.config_loader import load_config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def test_the_page_has_one_block_per_plugin_kind():
    assert len(BLOCKS) == 8


@pytest.fixture(scope="module")
def executed() -> None:
    for i, block in enumerate(BLOCKS):
        exec(compile(block, f"{PAGE}:block{i}", "exec"), {"__name__": f"docs_extending_{i}"})


def test_every_python_block_runs_and_its_names_select_from_the_config(executed):
    cfg = load_config(
        RunConfig,
        None,
        [
            "actor.policy_loss_mode=reinforce",
            "algorithm.adv_estimator=group_mean",
            "algorithm.kl_penalty=half_sq",
            "actor.kl_loss_type=half_sq",
            "actor.loss_agg_mode=token-sum",
            "rollout.name=counted_native",
            "actor.engine.backend=fsdp_logged",
        ],
    )
    assert cfg.rollout.name == "counted_native" and cfg.actor.engine.backend == "fsdp_logged"
    agent = load_config(RunConfig, None, ["rollout.multi_turn.enable=true", "rollout.multi_turn.env=guess_twice"])
    assert agent.rollout.multi_turn.env == "guess_twice"
    with pytest.raises(ValueError, match="group_mean compares the samples"):
        load_config(RunConfig, None, ["algorithm.adv_estimator=group_mean", "rollout.n=1"])
