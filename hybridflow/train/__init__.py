"""The training loops on the controller: PPO / GRPO (sync and async), SFT; the job and its recovery,
checkpointing, validation, metrics."""
