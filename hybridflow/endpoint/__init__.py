"""The OpenAI-compatible endpoint (`hybridflow serve`): request formats, sessions that record every
sampled token, the generation backend and batcher, and harness training (rollout.agent)."""
