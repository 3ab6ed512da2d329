"""`DPOConfig`: a preference-optimisation (DPO) run as one nested dataclass, and its resolve stage.

    cfg = load_config(DPOConfig, yaml, overrides)   # user values (None = derive), checked at load
    measured = measure_dtypes(cfg.trainer, [cfg.engine.param_dtype])
    run = resolve_dpo(cfg, steps_per_epoch, measured)                 # every derived value, then frozen

As `hybridflow sft` (config/sft.py): the trainer section is the shared `JobConfig`, resolved by
the same `resolve_trainer`; derived here are the LR schedule length and the engine's fsdp_size /
reshard_after_forward. The defaults train the bundled SmolLM2-135M-Instruct with the sigmoid (DPO) loss on the
arithmetic task's generated preference set (hybridflow/data/preference.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridflow.algos.dpo import DPOLossConfig
from hybridflow.config.data import TaskFilesConfig, one_of, positive
from hybridflow.config.measure import Measurements
from hybridflow.config.resolve import resolve_engine, resolve_schedule, resolve_trainer
from hybridflow.config.sft import SFT_TRUNCATIONS, ResolvedJob
from hybridflow.config.trainer import JobConfig
from hybridflow.data.preference import INVALID_PAIRS, check_preference_task
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.utils.config_loader import ConfigError, Section, freeze
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.engines import check_engine_backend


@dataclass
class PreferenceDataConfig(TaskFilesConfig):
    """Preference pairs: files in TRL's prompt/chosen/rejected columns (or a generated task's set), lengths,
    batch sizes (counted in pairs), and what to do with pairs that teach nothing."""

    gen_val_size: int = 128
    """Number of validation pairs to generate."""
    prompt_key: str = "prompt"
    """Column with the prompt: a string (one user turn) or a chat message list; dotted keys read a dict column."""
    chosen_key: str = "chosen"
    """Column with the preferred response: a string or one assistant message."""
    rejected_key: str = "rejected"
    """Column with the dispreferred response: a string or one assistant message."""
    invalid_pairs: str = "drop"
    """Pairs with an empty side or identical responses: "drop" counts and drops them, "error" refuses the file."""
    max_length: int = 256
    """Most tokens of prompt + the longer response per pair."""
    truncation: str = "error"
    """For pairs longer than max_length: "error" refuses them, "left" drops the prompt's first tokens,
    "right" drops the responses' last tokens."""
    train_batch_size: int = 32
    """Pairs per optimizer step, for the whole run (split evenly over the workers)."""
    micro_batch_size_per_device: int = 4
    """Pairs per forward/backward on one worker (each pair is two rows: chosen and rejected)."""
    shuffle: bool = True
    """Shuffle the training pairs every epoch (order derived from seed and epoch)."""
    seed: int = 0
    """Seed of the epoch shuffles and of task generation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task and not self.train_files:
            check_preference_task(self.task)
        positive(
            **{
                "data.train_batch_size": self.train_batch_size,
                "data.max_length": self.max_length,
                "data.micro_batch_size_per_device": self.micro_batch_size_per_device,
            }
        )
        one_of("data.truncation", self.truncation, SFT_TRUNCATIONS)
        one_of("data.invalid_pairs", self.invalid_pairs, INVALID_PAIRS)
        for key in ("prompt_key", "chosen_key", "rejected_key"):
            if not getattr(self, key).strip("."):
                raise ValueError(f"data.{key} must name a column, got {getattr(self, key)!r}")


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=1e-6)


def _default_trainer() -> JobConfig:
    return JobConfig(
        experiment_name="dpo", total_epochs=1, test_freq=16, save_freq=32, logger=["console", "jsonl", "tensorboard"]
    )


@dataclass
class DPOConfig(Section):
    """Everything one DPO run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train; its initial weights are the reference policy."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Preference pairs, lengths, batch sizes."""
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)
    """The preference loss (loss_type, beta, label_smoothing) and whether a reference is used."""
    optim: OptimConfig = field(default_factory=_default_optim)
    """AdamW and the LR schedule (its length defaults to the run's steps)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """How the model trains on each worker (FSDP2); the frozen reference copy runs with the same settings."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full training (rank 0: off); the reference is then the model with its
    adapters disabled, not a second copy."""
    trainer: JobConfig = field(default_factory=_default_trainer)
    """Run length, validation/checkpoint frequency, loggers, backend, workers."""

    @property
    def world_size(self) -> int:
        """Worker processes in the run."""
        return self.trainer.n_workers_per_node * self.trainer.nnodes

    def __post_init__(self) -> None:
        check_engine_backend("engine", self.engine)
        t = self.trainer
        if t.n_workers_per_node is None:
            raise ValueError(
                "trainer.n_workers_per_node=null (a layout chosen at load) is for hybridflow train; "
                "give DPO a number of workers, e.g. trainer.n_workers_per_node=2"
            )
        if self.data.train_batch_size % self.world_size:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size} pairs) must divide evenly over "
                f"{self.world_size} workers (trainer.n_workers_per_node * trainer.nnodes)"
            )
        if self.engine.ranks_per_dp_group != 1:
            raise ValueError(
                "engine.tensor_parallel_size / ulysses_sequence_parallel_size / pipeline_model_parallel_size > 1: "
                "DPO runs data parallel only"
            )


def resolve_dpo(cfg: DPOConfig, steps_per_epoch: int, measured: Measurements) -> ResolvedJob:
    """Fill every derived value of `cfg` (left untouched) into a frozen copy; see the module docstring.
    Pure: the machine comes in `measured` (`measure_dtypes(cfg.trainer, [cfg.engine.param_dtype])`)."""
    if steps_per_epoch < 1:
        raise ConfigError(
            f"the training set gives {steps_per_epoch} steps per epoch at data.train_batch_size="
            f"{cfg.data.train_batch_size} pairs; add pairs or lower the batch size"
        )
    trainer = resolve_trainer(cfg.trainer, steps_per_epoch, measured.cpu_count)
    engine = resolve_engine(
        cfg.engine, trainer.device, cfg.world_size, "", measured.dtype(cfg.engine.param_dtype, trainer.cpus_per_worker)
    )
    resolved = replace(
        cfg, trainer=trainer, engine=engine, optim=resolve_schedule(cfg.optim, trainer.total_training_steps, "")
    )
    return ResolvedJob(freeze(resolved), steps_per_epoch)
