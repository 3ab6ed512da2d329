"""load_config: YAML + a.b.c=value overrides into typed dataclasses, errors naming keys."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from hybridflow.config.data import DataConfig, RewardConfig
from hybridflow.config.trainer import AlgorithmConfig, TrainerConfig
from hybridflow.utils.config_loader import ConfigError, load_config, to_yaml


@dataclass
class Inner:
    """A small nested section."""

    lr: float = 1e-3
    """Learning rate."""
    steps: int = 10
    """Steps."""
    names: list[str] = field(default_factory=lambda: ["a"])
    """Names."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class Outer:
    """A small root config."""

    inner: Inner = field(default_factory=Inner)
    """The nested section."""
    maybe: Inner | None = None
    """An optional section."""
    tag: str = "x"
    """A string."""
    copy_steps: int = "${inner.steps}"  # type: ignore[assignment]
    """Interpolated from inner.steps."""

    def __post_init__(self) -> None:
        assert isinstance(self.inner, Inner), "nested sections are built before their parent"
        if self.tag == "bad" and self.inner.steps > 5:
            raise ValueError("tag=bad needs inner.steps <= 5")


@dataclass
class Run:
    """Root made of the trainer's own sections, as the integrator's RunConfig will be."""

    data: DataConfig = field(default_factory=DataConfig)
    """Data section."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward section."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Algorithm section."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer section."""


def test_defaults_yaml_then_overrides(tmp_path):
    assert load_config(Outer) == Outer(copy_steps=10)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("inner:\n  lr: 0.5\n  steps: 3\ntag: from_yaml\n")
    cfg = load_config(Outer, yaml, ["inner.steps=4", "inner.names=[p,q]", "maybe.lr=2"])
    assert cfg.inner == Inner(lr=0.5, steps=4, names=["p", "q"])
    assert cfg.tag == "from_yaml" and cfg.copy_steps == 4
    assert cfg.maybe == Inner(lr=2.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["inner.step=3"], r"unknown config key 'inner.step'; did you mean \['inner.steps'\]"),
        (["tga=y"], r"unknown config key 'tga'; did you mean \['tag'\]"),
        (["inner.steps=many"], r"command-line overrides: bad value for config key 'inner.steps'"),
        (["inner.lr=-1"], r"config section 'inner': lr must be > 0"),
        (["maybe.lr=-1"], r"config section 'maybe': lr must be > 0"),
        (["tag=bad"], r"config section 'Outer': tag=bad needs inner.steps <= 5"),
        (["inner.steps"], r"override 'inner.steps' is not of the form key.sub=value"),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Outer, None, overrides)


def test_interpolations_resolve_against_every_layer_as_hydra_does(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        "inner:\n  steps: 3\n  lr: ${oc.select:maybe.lr,0.25}\n  names: ['${tag}', '${..steps}']\ntag: t${inner.steps}\n"
    )
    cfg = load_config(Outer, yaml)
    assert cfg.inner == Inner(lr=0.25, steps=3, names=["t3", "3"]) and cfg.tag == "t3"
    # a later layer's value is what the file's ${...} follow (Hydra merges, then resolves)
    cfg = load_config(Outer, yaml, ["inner.steps=7", "maybe.lr=2"])
    assert cfg.inner == Inner(lr=2.0, steps=7, names=["t7", "7"]) and cfg.tag == "t7" and cfg.copy_steps == 7
    yaml.write_text("tag: ${inner.steps}\n")  # a key no layer sets: resolved against the defaults at build
    assert load_config(Outer, yaml).tag == "10"


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(Outer, None, ["inner.steps=many", "inner.lr=fast", "tag=ok"])
    lines = str(err.value).splitlines()
    assert lines[0] == "2 config keys are wrong:" and len(lines) == 3
    assert "'inner.steps'" in lines[1] and "'inner.lr'" in lines[2]
    with pytest.raises(ConfigError) as err:  # unknown keys and bad values of every layer: one message
        load_config(Outer, None, ["inner.step=3", "inner.lr=fast", "nope.deep=1"])
    lines = str(err.value).splitlines()
    assert lines[0] == "3 config keys are wrong:" and len(lines) == 4, lines
    assert "unknown config key 'inner.step'" in lines[1] and "unknown config key 'nope'" in lines[2]
    assert "bad value for config key 'inner.lr'" in lines[3]


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*unknown config key 'inner.lrr'.*inner.lr"):
        load_config(Outer, bad)
    bad.write_text("inner: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml' is not valid YAML"):
        load_config(Outer, bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Outer, bad)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(Outer, tmp_path / "nope.yaml")


def test_run_sections_load_and_round_trip(tmp_path):
    cfg = load_config(
        Run,
        None,
        [
            "data.train_batch_size=8",
            "data.task_kwargs.max_digits=1",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_penalty=low_var_kl+",
            "trainer.logger=[console,jsonl]",
            "data.train_files=/x/train.parquet",
        ],
    )
    assert cfg.data.train_batch_size == 8 and cfg.data.task_kwargs == {"max_digits": 1}
    assert cfg.data.train_files == ["/x/train.parquet"]
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.trainer.logger == ["console", "jsonl"]
    # derived values stay unset until the run is resolved (tests/test_resolve.py)
    assert cfg.trainer.default_local_dir is None and cfg.trainer.cpus_per_worker is None
    saved = tmp_path / "saved.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(Run, saved) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.task=null"], "set data.train_files to parquet file.*or data.task"),
        (["data.task=sudoku"], "data.task='sudoku' is not a registered task"),
        (["data.task_kwargs.digits=3"], "no difficulty setting 'digits'"),
        (["data.truncation=middle"], r"data.truncation must be one of \['error', 'left', 'right'\]"),
        (["data.train_batch_size=0"], "data.train_batch_size must be >= 1"),
        (["data.train_files=3"], "data.train_files must be a path or a list of paths"),
        (
            ["reward.custom_reward_function.path=/no/such.py"],
            r"custom_reward_function.path '/no/such.py' does not exist",
        ),
        (
            ["algorithm.adv_estimator=ppo2"],
            r"algorithm.adv_estimator='ppo2' is not a registered advantage estimator; known: .*grpo",
        ),
        (["algorithm.kl_penalty=l2"], "algorithm.kl_penalty must be one of"),
        (["algorithm.kl_penalty=full"], "algorithm.kl_penalty must be one of"),
        (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type must be one of"),
        (["algorithm.gamma=1.5"], "algorithm.gamma and algorithm.lam must lie in"),
        (["trainer.resume_mode=resume_path"], "needs trainer.resume_from_path"),
        (
            ["trainer.logger=[console,tensorbord]"],
            r"trainer.logger='tensorbord' is not a registered logger; known: console",
        ),
        (["trainer.placement=split", "trainer.n_workers_per_node=1"], "placement=split needs at least 2 workers"),
        (["trainer.test_freq=0"], "trainer.test_freq must be -1"),
        (["trainer.backend=slurm"], "trainer.backend must be one of"),
        (["trainer.total_epochs=two"], "bad value for config key 'trainer.total_epochs'"),
        (["trainer.cpus_per_worker=0"], "trainer.cpus_per_worker must be >= 1"),
        (["trainer.call_timeout_s=0"], r"trainer.call_timeout_s must be > 0 seconds \(null: the device's default\)"),
        (["trainer.collective_timeout_s=-5"], "trainer.collective_timeout_s must be > 0 seconds"),
    ],
)
def test_run_section_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Run, None, overrides)
