"""Agentic RL, in two sub-packages that share nothing but the loop's trajectory type:

- `loop/`: the in-worker multi-turn agent loop. `env.py`: the `Environment` users write (`reset(row)`,
  `step(text)`), the `ENVIRONMENTS` registry and the built-in `ToolEnvironment` ("tool"); `tool_calls.py`: the
  `<tool_call>{json}</tool_call>` format and chat-template rendering; `tools/`: the `Tool` interface, the `TOOLS`
  registry, `calculator`, `python` (in the bubblewrap sandbox, `tools/sandbox.py`); `tokens.py`: prompt and
  observation token ids from the chat template (tokenized once); `runner.py`: `run_agent_loop`, the token-exact
  loop over a batched turn generator; `batch.py`: trajectories -> DataProto in the rollout layout. A `Rollout`
  runs it through `rollout/multi_turn.py` (rollout.multi_turn).
- `server/`: the OpenAI-compatible endpoint (`hybridflow serve`). `app.py`: the HTTP server that records every
  sampled token per session; `openai_format.py` (request/response shapes), `limits.py` (bounds on requests),
  `sessions.py` (token capture), `backend.py` (the generation backend and the request batcher),
  `rollout_backend.py` (a Rollout as one); `harness.py`: training a plain openai-client harness (rollout.agent)
  against the worker's own rollout, `harness_batch.py` (its sessions -> the batch), `examples/` (harnesses).
"""
