"""The control flow of RL training: config sections, the PPO/GRPO trainer and the CLI."""
