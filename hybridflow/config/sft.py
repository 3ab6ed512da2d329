"""`SFTConfig`: a supervised fine-tuning run as one nested dataclass, and its resolve stage.

    cfg = load_config(SFTConfig, yaml, overrides)   # user values (None = derive), checked at load
    measured = measure_dtypes(cfg.trainer, [cfg.engine.param_dtype])  # this machine (config/measure.py)
    run = resolve_sft(cfg, steps_per_epoch, measured)                 # every derived value, then frozen

The trainer section is the shared `JobConfig` (config/trainer.py: no RL-only keys), resolved by the same
`resolve_trainer` as the RL trainer's (run directories, threads per worker, run length). Derived here as well: the LR
schedule length (optim.total_training_steps), the engine's fsdp_size /
reshard_after_forward, and engine.packing from data.packing.
The defaults fine-tune the bundled SmolLM2-135M-Instruct on a generated SFT set of the
arithmetic task.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hybridflow.config.data import TaskFilesConfig, one_of, positive
from hybridflow.config.measure import Measurements
from hybridflow.config.resolve import resolve_engine, resolve_schedule, resolve_trainer
from hybridflow.config.trainer import JobConfig
from hybridflow.data.sft import check_sft_task
from hybridflow.engine.config import EngineConfig, LoraConfig, OptimConfig
from hybridflow.utils.config_loader import ConfigError, Section, freeze, to_yaml
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.engines import check_engine_backend

SFT_TRUNCATIONS = ("error", "left", "right")
"""What to do with an example longer than data.max_length (see SFTDataConfig.truncation)."""


@dataclass
class SFTDataConfig(TaskFilesConfig):
    """Prompt/response examples: files (or a generated task's SFT set), lengths, batch sizes, packing.

    The loss covers the response tokens only (the answer and its EOS); the prompt — the chat
    template with the generation prompt, and with `messages_key` every turn before the last
    assistant turn, earlier assistant turns included — is masked out. Generated sets
    (hybridflow/data/sft.py) hold all three layouts below.
    """

    gen_val_size: int = 128
    """Number of validation examples to generate."""
    prompt_key: str = "prompt"
    """Column with the prompt: a string (templated as one user turn) or a chat message list; a dotted
    key reads a field of a dict column (verl's extra_info.question)."""
    response_key: str = "response"
    """Column with the response string (dotted keys allowed, e.g. extra_info.answer)."""
    messages_key: str | None = None
    """Column with a chat `messages` list; when set, prompt_key/response_key are not read and the
    last assistant turn is the response."""
    max_length: int = 256
    """Most tokens of prompt + response per example."""
    truncation: str = "error"
    """For examples longer than max_length: "error" refuses them, "left" drops the prompt's first tokens,
    "right" drops the response's last tokens."""
    train_batch_size: int = 32
    """Examples per optimizer step, for the whole run (split evenly over the workers)."""
    micro_batch_size_per_device: int = 4
    """Examples per forward/backward on one worker (gradient accumulation inside a step)."""
    packing: bool = False
    """Run each micro-batch as one packed row of real tokens (no padding FLOPs); same loss as unpacked."""
    shuffle: bool = True
    """Shuffle the training examples every epoch (order derived from seed and epoch)."""
    seed: int = 0
    """Seed of the epoch shuffles and of task generation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task and not self.train_files:
            check_sft_task(self.task, self.messages_key)
        positive(
            **{
                "data.train_batch_size": self.train_batch_size,
                "data.max_length": self.max_length,
                "data.micro_batch_size_per_device": self.micro_batch_size_per_device,
            }
        )
        one_of("data.truncation", self.truncation, SFT_TRUNCATIONS)
        for key, value in (
            ("data.prompt_key", self.prompt_key),
            ("data.response_key", self.response_key),
            ("data.messages_key", self.messages_key),
        ):
            if value is not None and not value.strip("."):
                raise ValueError(f"{key} must name a column, got {value!r}")


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


def _default_trainer() -> JobConfig:
    return JobConfig(
        experiment_name="sft", total_epochs=1, test_freq=16, save_freq=32, logger=["console", "jsonl", "tensorboard"]
    )


@dataclass
class SFTConfig(Section):
    """Everything one supervised fine-tuning run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Examples, lengths, batch sizes, packing."""
    optim: OptimConfig = field(default_factory=_default_optim)
    """AdamW and the LR schedule (its length defaults to the run's steps)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """How the model trains on each worker (FSDP2); engine.packing follows data.packing."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (rank 0: off); export merges them or writes a peft dir."""
    trainer: JobConfig = field(default_factory=_default_trainer)
    """Run length, validation/checkpoint frequency, loggers, backend, workers."""

    @property
    def world_size(self) -> int:
        """Worker processes in the run."""
        return self.trainer.n_workers_per_node * self.trainer.nnodes

    def __post_init__(self) -> None:
        check_engine_backend("engine", self.engine)
        t, world = self.trainer, self.world_size
        if t.n_workers_per_node is None:
            raise ValueError(
                "trainer.n_workers_per_node=null (a layout chosen at load) is for hybridflow train; "
                "give SFT a number of workers, e.g. trainer.n_workers_per_node=2"
            )
        if self.data.train_batch_size % world:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must divide evenly over {world} "
                "workers (trainer.n_workers_per_node * trainer.nnodes)"
            )
        if self.engine.ranks_per_dp_group != 1:
            raise ValueError(
                "engine.tensor_parallel_size / ulysses_sequence_parallel_size / pipeline_model_parallel_size > 1: "
                "SFT runs data parallel only"
            )
        if self.engine.packing and not self.data.packing:
            raise ValueError(
                "engine.packing=true conflicts with data.packing=false: engine.packing is derived; "
                "set only data.packing"
            )


@dataclass(frozen=True)
class ResolvedJob:
    """An SFT or DPO run (config/sft.py, config/dpo.py) with nothing left to derive."""

    config: Any
    """The config with every derived value filled in; frozen."""
    steps_per_epoch: int
    """Optimizer steps in one pass over the training examples (or preference pairs)."""

    @property
    def total_steps(self) -> int:
        """Training steps of the whole run."""
        return self.config.trainer.total_training_steps

    def to_yaml(self) -> str:
        """The resolved config (loadable with --config) and the steps per epoch as a comment."""
        return to_yaml(self.config) + f"# resolved plan:\n#   steps_per_epoch: {self.steps_per_epoch}\n"


def resolve_sft(cfg: SFTConfig, steps_per_epoch: int, measured: Measurements) -> ResolvedJob:
    """Fill every derived value of `cfg` (left untouched) into a frozen copy; see the module docstring.
    Pure: the machine comes in `measured` (`measure_dtypes(cfg.trainer, [cfg.engine.param_dtype])`)."""
    if steps_per_epoch < 1:
        raise ConfigError(
            f"the training set gives {steps_per_epoch} steps per epoch at data.train_batch_size="
            f"{cfg.data.train_batch_size}; add examples or lower the batch size"
        )
    trainer = resolve_trainer(cfg.trainer, steps_per_epoch, measured.cpu_count)
    engine = replace(
        resolve_engine(
            cfg.engine,
            trainer.device,
            cfg.world_size,
            "",
            measured.dtype(cfg.engine.param_dtype, trainer.cpus_per_worker),
        ),
        packing=cfg.data.packing,
    )
    resolved = replace(
        cfg, trainer=trainer, engine=engine, optim=resolve_schedule(cfg.optim, trainer.total_training_steps, "")
    )
    return ResolvedJob(freeze(resolved), steps_per_epoch)
