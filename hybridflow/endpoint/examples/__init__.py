"""Agent harnesses written as plain `openai`-client code, to train with `rollout.agent.function`."""
